//! Disaggregated serving between TensorRT-LLM workers, end to end through the real binary: a
//! gateway, two `switchyard worker --engine trtllm --role prefill` and one `--role decode` in
//! front of `trtllm-serve` stand-ins (`tests/python/fake_trtllm.py`), which split a request the
//! way TensorRT-LLM's context and generation servers do (`disaggregated_params`: a context-only
//! request whose KV the generation server's cache transceiver fetches).
//!
//! A long prompt is prefilled on a context worker and decoded on the generation worker, whose
//! engine receives the prompt's blocks instead of computing them and answers what an aggregated
//! run answers; a context engine that loses the KV after answering costs a retry on the other
//! context worker (blamed on the prefill, the decode worker kept); a dead context engine costs
//! a retry, and with none left `auto` serves aggregated on the generation worker while
//! `enforce` refuses. A healthy vLLM prefill worker of the same model is never paired with the
//! TensorRT-LLM decode worker: their engines cannot exchange KV.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::engine_pd_e2e::{complete, decisions, gateway, sees_workers, stream};
use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::fake_engine::{Fake, explain, indexed, overlap};
use support::fake_trtllm::FakeTrtllm;
use support::{Api, eventually, tokens};
use switchyard_testkit::EtcdServer;

const BLOCK: u64 = 4;

/// Makes `worker` (in front of `fake`) the gateway's clear prefill choice for `prompt`.
async fn prefer_prefill(api: &Api, worker: &str, fake: &FakeTrtllm, prompt: &[u32]) {
    fake.admin("store", json!({"tokens": prompt})).await;
    let ok = eventually(Duration::from_secs(15), || async {
        explain(&api.base, prompt).await["disaggregation"]["prefill"]["worker"] == worker
    })
    .await;
    assert!(ok, "{}", explain(&api.base, prompt).await);
}

/// The generation stand-in's received transfers, once it has seen `n`.
async fn received(fake: &FakeTrtllm, n: usize) -> Vec<Value> {
    let ok = eventually(Duration::from_secs(10), || async {
        fake.transfers().await["received"]
            .as_array()
            .map_or(0, Vec::len)
            >= n
    })
    .await;
    let all = fake.transfers().await["received"].clone();
    assert!(ok, "generation engine saw {all}, wanted {n} transfers");
    all.as_array().unwrap().clone()
}

/// The last `n` decision records of `stage`, oldest first.
async fn last(api: &Api, stage: &str, n: usize) -> Vec<Value> {
    let mut all: Vec<Value> = decisions(api, stage).await.into_iter().take(n).collect();
    all.reverse();
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_context_and_generation_workers_split_a_request_through_disaggregated_params() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("trtllm-pd-{}", std::process::id());
    let ctx_a = FakeTrtllm::start(&[]).await;
    let ctx_b = FakeTrtllm::start(&[]).await;
    let generation = FakeTrtllm::start(&[]).await;
    let worker =
        |fake: &FakeTrtllm, id, role| fake.worker(id, &endpoint, &cluster).role(role).start();
    let _wa = worker(&ctx_a, "ctx-a", "prefill").await;
    let _wb = worker(&ctx_b, "ctx-b", "prefill").await;
    let _wg = worker(&generation, "gen", "decode").await;
    // A healthy vLLM prefill worker of the same model and block size: its KV connector cannot
    // hand KV to a TensorRT-LLM engine, so it must never be paired with `gen`.
    let vllm = Fake::start(&["--kv-transfer"]).await;
    let _wv = vllm
        .worker("vllm", "prefill-vllm", &endpoint, &cluster)
        .role("prefill")
        .start()
        .await;
    let (_enforce, strict) = gateway(&endpoint, &cluster, "enforce").await;
    let (_auto, auto) = gateway(&endpoint, &cluster, "auto").await;
    let all = ["ctx-a", "ctx-b", "gen", "prefill-vllm"];
    sees_workers(&strict, &all).await;
    sees_workers(&auto, &all).await;

    // Through both pools: prefilled on a context worker, decoded on the generation worker.
    let y = tokens(2, 40);
    let (status, disaggregated) = complete(&strict, &y, 5).await;
    assert_eq!(status, 200, "{disaggregated}");
    assert_eq!(disaggregated["usage"]["completion_tokens"], 5);
    let prefill = decisions(&strict, "prefill").await;
    assert_eq!(prefill.len(), 1, "{prefill:?}");
    let chosen = prefill[0]["explanation"]["chosen"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(chosen == "ctx-a" || chosen == "ctx-b", "{prefill:?}");
    assert_eq!(
        decisions(&strict, "decode").await[0]["explanation"]["chosen"],
        "gen"
    );
    let (ctx, idle) = if chosen == "ctx-a" {
        (&ctx_a, &ctx_b)
    } else {
        (&ctx_b, &ctx_a)
    };
    // The context engine computed the prompt and handed its KV over once; the generation
    // engine received the prompt's blocks and computed none of them.
    let handed = ctx.transfers().await;
    assert_eq!(
        (&handed["computed_tokens"], &handed["handed_over"]),
        (&json!(40), &json!(1)),
        "{handed}"
    );
    assert_eq!(idle.transfers().await["computed_tokens"], 0);
    let transfer = &received(&generation, 1).await[0];
    assert_eq!(transfer["outcome"], "transferred", "{transfer}");
    assert_eq!(transfer["blocks"], 40 / BLOCK);
    assert_eq!(transfer["params"]["request_type"], "generation_only");
    let ctx_id = transfer["params"]["ctx_request_id"].as_u64().unwrap();
    let sent = ctx.admin("requests", json!({})).await["requests"][0].clone();
    assert_eq!(
        sent["disaggregated_params"],
        json!({"request_type": "context_only"})
    );
    let taken = generation.transfers().await;
    assert_eq!(
        (&taken["transferred_blocks"], &taken["computed_tokens"]),
        (&json!(40 / BLOCK), &json!(0)),
        "{taken}"
    );
    assert!(ctx.transfers().await["held"].as_array().unwrap().is_empty());
    // The generation engine's events show the received blocks on `gen`.
    let indexed_y = eventually(Duration::from_secs(15), || async {
        overlap(&strict.base, "gen", &y).await == 40 / BLOCK
            && overlap(&auto.base, "gen", &y).await == 40 / BLOCK
    })
    .await;
    assert!(indexed_y, "gen's received blocks reach the index");
    assert!(indexed(&strict.base, "gen").await.is_some());
    assert!(ctx_id > 0);

    // The answer is the aggregated one: `auto` finds Y cached on `gen` and serves it there.
    let (status, aggregated) = complete(&auto, &y, 5).await;
    assert_eq!(status, 200, "{aggregated}");
    assert_eq!(
        aggregated["choices"][0]["text"],
        disaggregated["choices"][0]["text"]
    );
    assert!(decisions(&auto, "prefill").await.is_empty());
    // The context engine samples the first token as the request asks (its seed here): a seeded
    // request's disaggregated answer is its aggregated one too.
    let seeded = |prompt: &[u32]| {
        json!({"model": "fake-model", "prompt": prompt, "max_tokens": 5, "ignore_eos": true,
               "seed": 11})
    };
    let z = tokens(9, 40);
    let (status, split) = strict.post("/v1/completions", &seeded(&z)).await;
    assert_eq!(status, 200, "{split}");
    assert_eq!(decisions(&strict, "prefill").await.len(), 2);
    let cached_z = eventually(Duration::from_secs(15), || async {
        overlap(&auto.base, "gen", &z).await == 40 / BLOCK
    })
    .await;
    assert!(cached_z, "the auto gateway sees Z's blocks on gen");
    let (status, whole) = auto.post("/v1/completions", &seeded(&z)).await;
    assert_eq!(status, 200, "{whole}");
    assert!(decisions(&auto, "prefill").await.is_empty());
    assert_eq!(split["choices"][0]["text"], whole["choices"][0]["text"]);
    assert_ne!(
        split["choices"][0]["text"], disaggregated["choices"][0]["text"],
        "the seed changes the completion"
    );
    // Streamed, disaggregated as well.
    stream(&strict, &tokens(3, 40), 6).await;
    assert_eq!(received(&generation, 3).await[2]["outcome"], "transferred");

    // ctx-a's engine answers the context request, then loses the KV: the generation engine's
    // transfer fails inside its stream, the decode worker reports a failed pull, and the
    // gateway retries with ctx-b on the same decode worker.
    let v = tokens(4, 40);
    prefer_prefill(&strict, "ctx-a", &ctx_a, &v).await;
    ctx_a.admin("lose_transfers", json!({"count": 1})).await;
    let (status, body) = complete(&strict, &v, 4).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 4);
    let tried = last(&strict, "prefill", 2).await;
    assert_eq!(
        (
            &tried[0]["explanation"]["chosen"],
            &tried[1]["explanation"]["chosen"]
        ),
        (&json!("ctx-a"), &json!("ctx-b")),
        "{tried:?}"
    );
    assert_eq!(tried[0]["request_id"], tried[1]["request_id"]);
    let decoded = last(&strict, "decode", 2).await;
    assert!(
        decoded.iter().all(|d| d["explanation"]["chosen"] == "gen"),
        "{decoded:?}"
    );
    let after = received(&generation, 5).await;
    assert_eq!(
        (&after[3]["outcome"], &after[4]["outcome"]),
        (&json!("failed"), &json!("transferred"))
    );

    // ctx-a's engine dies while ctx-a is the preferred choice: its prefill fails at once and
    // the request is retried on ctx-b.
    let w = tokens(5, 40);
    prefer_prefill(&strict, "ctx-a", &ctx_a, &w).await;
    drop(ctx_a);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, body) = complete(&strict, &w, 4).await;
    assert_eq!(status, 200, "{body}");
    let tried = last(&strict, "prefill", 2).await;
    assert_eq!(
        (
            &tried[0]["explanation"]["chosen"],
            &tried[1]["explanation"]["chosen"]
        ),
        (&json!("ctx-a"), &json!("ctx-b")),
        "{tried:?}"
    );
    assert_eq!(received(&generation, 6).await[5]["outcome"], "transferred");

    // No context engine left: `auto` falls back to aggregated on the generation worker, whose
    // engine computes the prompt itself; `enforce` refuses rather than pairing `gen` with the
    // vLLM prefill worker.
    drop(ctx_b);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = generation.transfers().await;
    let (status, body) = complete(&auto, &tokens(6, 40), 4).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 4);
    let now = generation.transfers().await;
    assert_eq!(now["transferred_blocks"], before["transferred_blocks"]);
    assert_eq!(
        now["computed_tokens"].as_u64().unwrap() - before["computed_tokens"].as_u64().unwrap(),
        40,
        "{now}"
    );
    let explained = explain(&auto.base, &tokens(7, 40)).await;
    assert_ne!(
        explained["disaggregation"]["prefill"]["worker"], "prefill-vllm",
        "{explained}"
    );
    let (status, body) = complete(&strict, &tokens(8, 40), 4).await;
    assert!(status >= 500, "{status} {body}");
    assert!(body.to_string().contains("prefill"), "{body}");
    for api in [&strict, &auto] {
        assert!(
            decisions(api, "prefill")
                .await
                .iter()
                .all(|d| d["explanation"]["chosen"] != "prefill-vllm")
        );
    }
    assert_eq!(vllm.admin("transfers", json!({})).await["handed_over"], 0);
}
