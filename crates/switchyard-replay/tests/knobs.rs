//! The agent-KV mechanism ablation (`switchyard replay agentx --engine-knobs`): each engine's
//! mechanisms are the ones `docs/engines.md` lists for it, and every row of the ablation comes
//! from a run in which that row's mechanisms act — on four short `dev_b_120` sessions on two
//! small workers, removing any one mechanism changes the pinned figures.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use serde_json::{Value, json};
use switchyard_replay::knobs::{self, EngineKnobs, KnobSettings, Mechanism, Mechanisms};
use switchyard_replay::{OfflineRun, replay_offline};
use switchyard_router::PolicyKind;

use crate::golden::check;
use crate::support::{cluster, dev_b_short};

/// The `docs/engines.md` table "Agent KV mechanisms per engine": per engine column, the
/// mechanisms whose cell starts with "yes".
fn documented(engine: EngineKnobs) -> Mechanisms {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/engines.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let section = text
        .split("## Agent KV mechanisms per engine")
        .nth(1)
        .expect("docs/engines.md has the per-engine mechanisms table");
    let column = match engine {
        EngineKnobs::Vllm => 1,
        EngineKnobs::Sglang => 2,
        EngineKnobs::Trtllm => 3,
        EngineKnobs::Sim => 4,
    };
    let mut set = Mechanisms::default();
    for (row, mechanism) in [
        ("host tier", Mechanism::Host),
        ("retention", Mechanism::Retention),
        ("placement", Mechanism::Placement),
        ("session scheduling", Mechanism::Sessions),
    ] {
        let line = section
            .lines()
            .find(|l| l.starts_with(&format!("| {row} |")))
            .unwrap_or_else(|| panic!("the table has a {row} row"));
        let cell = line.split('|').nth(column + 1).unwrap().trim();
        set = set.with(mechanism, cell.starts_with("yes"));
    }
    set
}

#[test]
fn each_engine_s_knobs_are_the_ones_docs_engines_md_lists() {
    for engine in EngineKnobs::ALL {
        assert_eq!(engine.mechanisms(), documented(engine), "{engine:?}");
    }
    // And what that is, so a change to both the table and the code is seen in review.
    let set = |e: EngineKnobs| {
        e.mechanisms()
            .list()
            .iter()
            .map(|m| m.as_str())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        set(EngineKnobs::Vllm),
        ["host", "placement", "sessions"],
        "vLLM: CPU offloading, kv_transfer_params, no retention"
    );
    assert_eq!(
        set(EngineKnobs::Sglang),
        ["host", "retention", "sessions"],
        "SGLang: HiCache, expiring radix-eviction priority, no placement between aggregated servers"
    );
    assert_eq!(set(EngineKnobs::Trtllm), ["host", "placement", "sessions"]);
    assert_eq!(
        set(EngineKnobs::Sim),
        ["host", "retention", "placement", "sessions"]
    );
}

#[test]
fn the_ablation_adds_each_mechanism_alone_and_removes_each_from_the_whole_set() {
    let names = |e| {
        knobs::ablation(e)
            .into_iter()
            .map(|r| r.name)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(EngineKnobs::Vllm),
        [
            "round-robin",
            "kv",
            "kv+host",
            "kv+placement",
            "kv+sessions",
            "vllm",
            "vllm-host",
            "vllm-placement",
            "vllm-sessions"
        ]
    );
    for engine in EngineKnobs::ALL {
        let set = engine.mechanisms();
        for row in knobs::ablation(engine) {
            let m = row.mechanisms;
            // No row uses a mechanism the engine lacks.
            assert!(
                m.list().iter().all(|&x| set.has(x)),
                "{engine:?} {}",
                row.name
            );
            assert_eq!(
                row.policy == PolicyKind::RoundRobin,
                row.name == "round-robin"
            );
        }
    }
}

fn figures(run: &OfflineRun) -> Value {
    let s = &run.summary;
    json!({
        "requests": s.requests_completed,
        "failed": s.requests_failed,
        "ttft_p50_ms": s.ttft_ms.p50,
        "ttft_p99_ms": s.ttft_ms.p99,
        "tpot_p50_ms": s.tpot_ms.p50,
        "hit_rate": s.cache_hit_rate,
        "host_hit_rate": s.host_hit_rate,
        "peer_hit_rate": s.peer_hit_rate,
        "recomputed_tokens": s.recomputed_tokens,
        "output_tok_s_per_worker": s.output_tok_s_per_worker,
        "held_turns": s.held_turns,
    })
}

/// The four short `dev_b_120` sessions, four at a time with think times cut tenfold, on two
/// workers of 1,536 blocks: kv alone, the simulator's whole set, and the set without each
/// mechanism (the rows a dropped mechanism would change).
#[test]
fn every_ablation_row_is_a_run_its_mechanisms_change() {
    let mut base = cluster(PolicyKind::Kv, 64, 1536, 0);
    base.workers = 2;
    let settings = KnobSettings::default();
    let mut rows = serde_json::Map::new();
    for row in knobs::ablation(EngineKnobs::Sim) {
        if row.name != "kv" && !row.name.starts_with("sim") {
            continue;
        }
        let config = switchyard_replay::ClusterConfig {
            policy: row.policy,
            ..row.mechanisms.apply(&base, &settings).unwrap()
        };
        let run = replay_offline(
            &mut dev_b_short(4, 0.1),
            &config,
            4.0,
            &indicatif::ProgressBar::hidden(),
        )
        .unwrap();
        assert_eq!(run.summary.sessions_completed, 4, "{}", row.name);
        rows.insert(row.name, figures(&run));
    }
    // Each mechanism, removed from the whole set, changes its figures: a mechanism that
    // silently did nothing (or was dropped) shows here.
    for m in Mechanism::ALL {
        let without = &rows[&format!("sim-{}", m.as_str())];
        assert_ne!(
            without,
            &rows["sim"],
            "removing {} changes the set",
            m.as_str()
        );
    }
    assert_ne!(rows["kv"], rows["sim"]);
    check("knobs-ablation-dev_b_120", Value::Object(rows));
}
