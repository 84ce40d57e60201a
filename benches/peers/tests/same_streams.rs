//! The side-by-side figures compare like with like only if every contender is fed the same
//! events and answers the same question. On small copies of each workload of the bench (the
//! synthetic population and churn, every worker holding the prompt, a slice of the Mooncake
//! trace and of the agent sessions), every contender's answer must equal the reference model's,
//! query by query. Nothing here is timed.
//!
//! `cd benches/peers && cargo test --release` (release: it reuses what `cargo bench` built).

use switchyard_peer_bench::contenders::{Contender, lineup};
use switchyard_peer_bench::traces::{self, Replay};
use switchyard_peer_bench::workload::{
    CHAIN_BLOCKS, Event, Op, Query, Reference, Scores, Synthetic, all_hold,
};

struct Run {
    line: Vec<Box<dyn Contender>>,
    reference: Reference,
    /// Queries whose answer named at least two workers (so agreement is not vacuous).
    shared_answers: usize,
}

impl Run {
    fn new(workers: usize) -> Self {
        let line = lineup(workers, false, &[]);
        assert_eq!(
            line.len(),
            5,
            "Switchyard and Dynamo's four event-fed indexers"
        );
        Self {
            line,
            reference: Reference::default(),
            shared_answers: 0,
        }
    }

    fn feed(&mut self, events: &[Event]) {
        for c in &mut self.line {
            c.apply(events);
        }
        for e in events {
            self.reference.apply(e);
        }
    }

    /// Every contender answers `q` as the reference does; returns that answer.
    fn agree(&mut self, q: &Query, what: &str) -> Scores {
        let want = self.reference.overlap(q);
        for c in &mut self.line {
            let (_, got) = c.overlap(q);
            assert_eq!(got, want, "{} on {what}", c.name());
        }
        self.shared_answers += usize::from(want.len() >= 2);
        want
    }

    fn no_refusals(&self) {
        for c in &self.line {
            assert_eq!(c.errors(), 0, "{} refused events", c.name());
        }
    }
}

fn prefix(q: &Query, len: usize) -> Query {
    Query {
        blocks: q.blocks[..len].to_vec(),
    }
}

#[test]
fn synthetic_population_and_churn_get_the_same_answers() {
    let spec = Synthetic {
        workers: 8,
        pairs: 1 << 15,
        prompt_len: 512,
        holders: 8,
        seed: 7,
    };
    let mut run = Run::new(spec.workers);
    let population: Vec<Event> = spec.population().collect();
    run.feed(&population);
    let prompt = spec.prompt();
    for len in [1, 63, 64, 65, 200, 512] {
        let got = run.agree(&prefix(&prompt, len), &format!("{len}-block prompt"));
        assert_eq!(got, spec.expected(len), "the analytic answer, {len} blocks");
    }
    // Churn: each store is queried while it is held, then removed; the batch leaves the index
    // as it found it, so the prompt's answers are unchanged afterwards.
    let churn = spec.churn(32);
    for pair in churn.chunks(2) {
        run.feed(&pair[..1]);
        let Op::Store { blocks, .. } = &pair[0].op else {
            panic!("churn pairs start with a store");
        };
        let got = run.agree(
            &Query {
                blocks: blocks.clone(),
            },
            "a churned chain",
        );
        assert!(got.contains(&(pair[0].worker, CHAIN_BLOCKS as u32)));
        run.feed(&pair[1..]);
    }
    for len in [64, 512] {
        let got = run.agree(&prefix(&prompt, len), "the prompt after churn");
        assert_eq!(got, spec.expected(len));
    }
    run.no_refusals();
    assert!(run.shared_answers > 0);
}

#[test]
fn every_worker_holding_the_prompt_gets_the_same_answers() {
    let spec = Synthetic {
        workers: 16,
        pairs: 1 << 14,
        prompt_len: 128,
        holders: 16,
        seed: 11,
    };
    let mut run = Run::new(spec.workers);
    let population: Vec<Event> = spec.population().collect();
    run.feed(&population);
    let prompt = spec.prompt();
    run.feed(&all_hold(spec.workers, &prompt));
    let got = run.agree(&prompt, "the prompt all workers hold");
    assert_eq!(got, (0..16).map(|w| (w, 128)).collect::<Scores>());
    run.no_refusals();
}

/// Replays `r` as the bench does (query, then the request's events) through every contender.
fn replay_agrees(r: &Replay) {
    let mut run = Run::new(r.workers);
    let mut removals = 0;
    for (k, step) in r.steps.iter().enumerate() {
        let got = run.agree(&step.query, &format!("{} request {k}", r.name));
        assert_eq!(got, step.expected, "the simulation's answer, request {k}");
        removals += step
            .events
            .iter()
            .filter(|e| matches!(e.op, Op::Remove { .. }))
            .count();
        run.feed(&step.events);
    }
    run.no_refusals();
    assert!(removals > 0, "the slice evicts");
    assert!(r.hit_blocks > 0, "the slice reuses prefixes");
    assert!(
        run.shared_answers > 0,
        "some prefixes are held by two workers"
    );
}

#[test]
fn a_mooncake_slice_gets_the_same_answers() {
    let path = traces::data_dir().join("traces/mooncake/conversation_trace.jsonl");
    let requests = traces::mooncake(&path).unwrap_or_else(|e| panic!("{e}"));
    replay_agrees(&traces::replay("mooncake", &requests[..800], 4, 256));
}

#[test]
fn an_agent_session_slice_gets_the_same_answers() {
    let path = traces::data_dir().join("agentx/weka_kv_cache_tester/sample_20.jsonl.gz");
    let requests = traces::weka(&path).unwrap_or_else(|e| panic!("{e}"));
    replay_agrees(&traces::replay("agent sessions", &requests[..300], 4, 4096));
}
