//! The vLLM/SGLang adapter against the protocol-faithful stand-in engine
//! (`tests/python/fake_vllm.py`: OpenAI HTTP, ZMQ PUB + ROUTER replay, its own block hashes).
//!
//! The stand-in reports the blocks it holds as token prefixes; the adapter's event log must end
//! up holding exactly Switchyard's chained hashes of those, through gaps, replays and restarts.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use switchyard_core::{BlockHash, BlockSize, EngineKind, WorkerId, block_hashes};
use switchyard_worker::config::EngineConfig;
use switchyard_worker::engine::vllm::VllmEngine;
use switchyard_worker::engine::{Engine, EngineError, FinishReason, GenerateParams, PrefillParams};
use switchyard_worker::event_log::SubscriptionStart;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/python/fake_vllm.py"
);

struct Fake {
    _child: Child,
    http: String,
    zmq: u16,
    replay: u16,
    bootstrap: u16,
    client: reqwest::Client,
}

impl Fake {
    async fn start(extra: &[&str]) -> Fake {
        let mut child = Command::new("python3")
            .arg(SCRIPT)
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs the stand-in (pip install pyzmq msgpack)");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("stand-in starts")
            .unwrap()
            .expect("stand-in prints READY");
        let ports: Value = serde_json::from_str(line.strip_prefix("READY ").unwrap()).unwrap();
        Fake {
            _child: child,
            http: format!("http://127.0.0.1:{}", ports["http"]),
            zmq: ports["zmq"].as_u64().unwrap() as u16,
            replay: ports["replay"].as_u64().unwrap() as u16,
            bootstrap: ports["bootstrap"].as_u64().unwrap() as u16,
            client: reqwest::Client::new(),
        }
    }

    async fn admin(&self, what: &str, body: Value) -> Value {
        self.client
            .post(format!("{}/admin/{what}", self.http))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn store(&self, tokens: Vec<u32>, rank: u32) {
        self.admin("store", json!({"tokens": tokens, "rank": rank}))
            .await;
    }

    /// Switchyard's hashes of every block the stand-in holds, over all ranks.
    async fn held(&self, bs: BlockSize) -> BTreeSet<BlockHash> {
        let state = self.admin("state", json!({})).await;
        let mut held = BTreeSet::new();
        for rank in state["ranks"].as_array().unwrap() {
            for prefix in rank.as_array().unwrap() {
                let tokens: Vec<u32> = serde_json::from_value(prefix.clone()).unwrap();
                held.insert(*block_hashes(&tokens, bs).last().unwrap());
            }
        }
        held
    }

    fn config(&self, kind: EngineKind, ranks: u32, replay: bool) -> EngineConfig {
        EngineConfig {
            kind,
            url: Some(self.http.clone()),
            kv_events: Some(format!("tcp://127.0.0.1:{}", self.zmq)),
            kv_replay: replay.then(|| format!("tcp://127.0.0.1:{}", self.replay)),
            dp_ranks: ranks,
            metrics_interval_ms: 50,
            startup_timeout_secs: 20,
            ..EngineConfig::default()
        }
    }
}

async fn start(config: EngineConfig) -> VllmEngine {
    let engine = VllmEngine::start(
        WorkerId::new("w").unwrap(),
        1,
        "fake-model",
        &config,
        1,
        4096,
    )
    .await
    .unwrap();
    // Let the SUB sockets connect before the stand-in publishes (PUB drops unsent messages).
    tokio::time::sleep(Duration::from_millis(300)).await;
    engine
}

fn logged(engine: &VllmEngine) -> BTreeSet<BlockHash> {
    match engine.events().subscribe(None, 0).start {
        SubscriptionStart::Snapshot { blocks, .. } => blocks.iter().map(|b| b.hash).collect(),
        SubscriptionStart::Replay(_) => unreachable!("no resume point was given"),
    }
}

/// Waits until the adapter's view equals what the stand-in holds.
async fn assert_mirrors(fake: &Fake, engine: &VllmEngine) {
    let bs = engine.spec().block_size;
    let want = fake.held(bs).await;
    for _ in 0..100 {
        if logged(engine) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "adapter view {:?} != engine {:?} (stats {:?})",
        logged(engine),
        want,
        engine.stats()
    );
}

fn seq(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

fn params(prompt: Vec<u32>, max_tokens: u32) -> GenerateParams {
    GenerateParams {
        request_id: "r1".into(),
        prompt,
        max_tokens,
        temperature: 0.0,
        seed: None,
        ignore_eos: true,
        stop_token_ids: Vec::new(),
    }
}

#[tokio::test]
async fn vllm_generation_and_kv_events_through_gap_replay_and_restart() {
    let fake = Fake::start(&["--block-size", "4", "--num-blocks", "64"]).await;
    let engine = start(fake.config(EngineKind::Vllm, 1, true)).await;
    assert_eq!(engine.spec().block_size.get(), 4);
    assert_eq!(engine.spec().kv_capacity_blocks, 64);
    assert_eq!(engine.spec().max_context_tokens, 4096);

    // Generation streams token ids; the repeat hits the cache.
    for round in 0..2 {
        let mut stream = engine.generate(params(seq(1, 10), 5)).await.unwrap();
        let mut tokens = Vec::new();
        let mut last = None;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.unwrap();
            tokens.extend(chunk.tokens.clone());
            last = Some(chunk);
        }
        let last = last.unwrap();
        assert_eq!(tokens.len(), 5);
        assert_eq!(last.finish, Some(FinishReason::Length));
        assert_eq!((last.prompt_tokens, last.completion_tokens), (10, 5));
        assert_eq!(last.cached_prompt_tokens, if round == 0 { 0 } else { 8 });
    }
    assert_mirrors(&fake, &engine).await;

    // A gap replay can repair: the next two batches reach only the replay buffer.
    fake.admin("drop_next", json!({"count": 2})).await;
    fake.store(seq(100, 8), 0).await;
    fake.store(seq(200, 8), 0).await;
    fake.store(seq(300, 8), 0).await;
    assert_mirrors(&fake, &engine).await;
    let stats = engine.stats();
    assert_eq!(
        (stats.gaps, stats.replays, stats.replayed_batches),
        (1, 1, 2)
    );

    // Malformed messages are counted and skipped; the stream goes on.
    fake.admin("malformed", json!({})).await;
    fake.store(seq(400, 8), 0).await;
    assert_mirrors(&fake, &engine).await;
    assert_eq!(engine.stats().malformed, 3);
    assert_eq!(engine.stats().gaps, 1);

    // An engine restart: everything known is dropped, then rebuilt from the new events.
    fake.admin("restart", json!({})).await;
    fake.store(seq(500, 12), 0).await;
    fake.store(seq(1, 8), 0).await;
    assert_mirrors(&fake, &engine).await;
    assert_eq!(engine.stats().restarts, 1);

    // A prefix-cache reset.
    fake.admin("clear", json!({})).await;
    fake.store(seq(600, 4), 0).await;
    assert_mirrors(&fake, &engine).await;

    // Load comes from /metrics.
    let load = engine.load();
    assert_eq!(load.capacity_blocks, 64);
    engine.shutdown();
}

#[tokio::test]
async fn a_gap_replay_cannot_cover_clears_the_rank_and_rebuilds() {
    let fake = Fake::start(&["--block-size", "4", "--buffer-steps", "2"]).await;
    let engine = start(fake.config(EngineKind::Vllm, 1, true)).await;
    fake.store(seq(1, 8), 0).await;
    assert_mirrors(&fake, &engine).await;
    // Lost for good: not even in the replay buffer.
    fake.admin("drop_next", json!({"count": 1, "forget": true}))
        .await;
    fake.store(seq(50, 8), 0).await;
    fake.store(seq(80, 8), 0).await;
    let bs = engine.spec().block_size;
    let fresh: BTreeSet<_> = block_hashes(&seq(80, 8), bs).into_iter().collect();
    for _ in 0..100 {
        if logged(&engine) == fresh {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The stale view was dropped and rebuilt from what followed the gap.
    assert_eq!(logged(&engine), fresh);
    let stats = engine.stats();
    assert_eq!((stats.gaps, stats.resyncs, stats.replays), (1, 1, 0));
    engine.shutdown();
}

#[tokio::test]
async fn map_encoding_byte_hashes_and_dp_ranks() {
    let fake = Fake::start(&[
        "--encoding",
        "map",
        "--hash-bytes",
        "--dp-ranks",
        "2",
        "--block-size",
        "8",
    ])
    .await;
    let engine = start(fake.config(EngineKind::Vllm, 2, true)).await;
    fake.store(seq(1, 24), 0).await;
    // Rank 1 shares the first block with rank 0 and has one of its own.
    fake.store(seq(1, 8).into_iter().chain(seq(900, 8)).collect(), 1)
        .await;
    assert_mirrors(&fake, &engine).await;
    // A prefix-cache reset on every rank, then new blocks on one.
    fake.admin("clear", json!({})).await;
    fake.store(seq(1, 16), 1).await;
    assert_mirrors(&fake, &engine).await;
    assert_eq!(engine.stats().malformed, 0);
    engine.shutdown();
}

#[tokio::test]
async fn sglang_generate_and_facts_from_server_info() {
    let fake = Fake::start(&["--flavor", "sglang", "--encoding", "map"]).await;
    let engine = start(fake.config(EngineKind::Sglang, 1, false)).await;
    assert_eq!(engine.spec().block_size.get(), 4);
    let mut stream = engine.generate(params(seq(1, 9), 4)).await.unwrap();
    let mut tokens = Vec::new();
    let mut finish = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        tokens.extend(chunk.tokens);
        finish = chunk.finish;
    }
    assert_eq!(tokens.len(), 4);
    assert_eq!(finish, Some(FinishReason::Length));
    assert_mirrors(&fake, &engine).await;
    engine.shutdown();
}

#[tokio::test]
async fn errors_map_to_whose_fault_and_dropping_a_stream_aborts() {
    let fake = Fake::start(&["--token-delay-ms", "20", "--max-model-len", "64"]).await;
    let engine = start(fake.config(EngineKind::Vllm, 1, false)).await;
    let err = engine.generate(params(seq(1, 60), 10)).await.unwrap_err();
    assert!(
        matches!(err, EngineError::InvalidRequest(ref m) if m.contains("context")),
        "{err}"
    );
    assert_eq!(
        tonic::Status::from(err).code(),
        tonic::Code::InvalidArgument
    );
    let err = engine
        .prefill(PrefillParams {
            request_id: "p".into(),
            prompt: seq(1, 4),
            hold: Duration::from_secs(1),
            pipelined: false,
        })
        .await
        .unwrap_err();
    // Without a KV connector vLLM answers no kv_transfer_params: not a prefill worker's engine.
    assert!(err.to_string().contains("kv-transfer-config"), "{err}");
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unimplemented);

    // Dropping the stream closes the HTTP request; the engine stops running it.
    let mut stream = engine.generate(params(seq(1, 8), 40)).await.unwrap();
    stream.next().await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(engine.load().running_requests, 1);
    drop(stream);
    let mut stopped = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if engine.load().running_requests == 0 {
            stopped = true;
            break;
        }
    }
    assert!(stopped, "the engine kept running a dropped request");

    // An unreachable engine is retryable.
    drop(fake);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let err = engine.generate(params(seq(1, 8), 4)).await.unwrap_err();
    assert!(matches!(err, EngineError::Unavailable(_)), "{err}");
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unavailable);
    engine.shutdown();
}

async fn collect(
    mut stream: switchyard_worker::engine::GenerationStream,
) -> (Vec<u32>, FinishReason) {
    let mut tokens = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        tokens.extend(chunk.tokens);
        if let Some(finish) = chunk.finish {
            return (tokens, finish);
        }
    }
    panic!("stream ended without a finish");
}

fn prefill_params(prompt: Vec<u32>, hold: Duration) -> PrefillParams {
    PrefillParams {
        request_id: "pd-1".into(),
        prompt,
        hold,
        pipelined: false,
    }
}

fn object(json: &str) -> serde_json::Map<String, Value> {
    match serde_json::from_str(json).unwrap() {
        Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

#[tokio::test]
async fn vllm_prefill_hands_its_kv_transfer_params_to_the_decode_engine() {
    let prefill_fake = Fake::start(&["--block-size", "4", "--kv-transfer"]).await;
    let decode_fake = Fake::start(&["--block-size", "4", "--kv-transfer"]).await;
    let prefill = start(prefill_fake.config(EngineKind::Vllm, 1, false)).await;
    let decode = start(decode_fake.config(EngineKind::Vllm, 1, true)).await;
    let prompt = seq(1, 10);

    let outcome = prefill
        .prefill(prefill_params(prompt.clone(), Duration::from_secs(30)))
        .await
        .unwrap();
    let transfer = object(outcome.engine_transfer_params.as_deref().unwrap());
    let prefill_id = prefill_fake.admin("transfers", json!({})).await["engine_id"].clone();
    assert_eq!(transfer["do_remote_prefill"], true);
    assert_eq!(transfer["remote_engine_id"], prefill_id);
    assert_eq!(transfer["remote_block_ids"].as_array().unwrap().len(), 2);
    assert_eq!(
        outcome.block_hashes,
        block_hashes(&prompt, BlockSize::new(4).unwrap())
    );
    assert_eq!(
        (outcome.prompt_tokens, outcome.cached_prompt_tokens),
        (10, 0)
    );

    // The decode engine gets the original prompt with those parameters and generates the whole
    // completion, starting with the token the prefill sampled.
    let (tokens, finish) = collect(
        decode
            .generate_with_transfer(params(prompt.clone(), 4), transfer.clone())
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((tokens.len(), finish), (4, FinishReason::Length));
    assert_eq!(tokens[0], outcome.first_token);
    let seen = decode_fake.admin("transfers", json!({})).await;
    assert_eq!(
        seen["received"][0]["params"],
        Value::Object(transfer.clone())
    );
    assert_eq!(seen["received"][0]["outcome"], "pulled");
    assert_eq!(
        prefill_fake.admin("transfers", json!({})).await["handed_over"],
        1
    );
    // The received blocks are in the decode engine's cache and its events.
    assert_mirrors(&decode_fake, &decode).await;
    let mirrored = logged(&decode);
    assert!(
        block_hashes(&prompt, decode.spec().block_size)
            .iter()
            .all(|h| mirrored.contains(h))
    );

    // SGLang's bootstrap parameters are not vLLM's: refused before the engine sees them.
    let err = decode
        .generate_with_transfer(
            params(prompt, 4),
            object(r#"{"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2}"#),
        )
        .await
        .unwrap_err();
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unimplemented);
    prefill.shutdown();
    decode.shutdown();
}

#[tokio::test]
async fn sglang_prefill_answers_at_once_and_the_decode_engine_takes_the_room() {
    let prefill_fake = Fake::start(&[
        "--flavor",
        "sglang",
        "--disaggregation-mode",
        "prefill",
        "--transfer-timeout",
        "20",
    ])
    .await;
    let decode_fake = Fake::start(&["--flavor", "sglang", "--disaggregation-mode", "decode"]).await;
    let mut config = prefill_fake.config(EngineKind::Sglang, 1, false);
    config.bootstrap_port = prefill_fake.bootstrap;
    let prefill = start(config).await;
    let decode = start(decode_fake.config(EngineKind::Sglang, 1, false)).await;
    let prompt = seq(1, 9);

    // The stand-in's prefill does not finish until a decode engine takes the room: the answer
    // comes before that, or this would wait for ever.
    let outcome = prefill
        .prefill(prefill_params(prompt.clone(), Duration::from_secs(20)))
        .await
        .unwrap();
    let transfer = object(outcome.engine_transfer_params.as_deref().unwrap());
    assert_eq!(transfer["bootstrap_host"], "127.0.0.1");
    assert_eq!(transfer["bootstrap_port"], prefill_fake.bootstrap);
    let room = transfer["bootstrap_room"].as_u64().unwrap();
    assert!(room <= i64::MAX as u64);
    assert_eq!(
        prefill_fake.admin("transfers", json!({})).await["handed_over"],
        0
    );

    let (tokens, finish) = collect(
        decode
            .generate_with_transfer(params(prompt.clone(), 3), transfer.clone())
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((tokens.len(), finish), (3, FinishReason::Length));
    let seen = decode_fake.admin("transfers", json!({})).await;
    assert_eq!(seen["received"][0]["params"], Value::Object(transfer));
    assert_eq!(seen["received"][0]["outcome"], "pulled");
    let mut handed = false;
    for _ in 0..100 {
        if prefill_fake.admin("transfers", json!({})).await["handed_over"] == 1 {
            handed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(handed, "the prefill engine never saw its room taken");
    assert_mirrors(&decode_fake, &decode).await;

    // A room nobody serves: the decode engine aborts, the adapter reports it.
    let mut bad = object(outcome.engine_transfer_params.as_deref().unwrap());
    bad.insert("bootstrap_port".into(), json!(1));
    let (_, finish) = collect(
        decode
            .generate_with_transfer(params(prompt.clone(), 3), bad)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(finish, FinishReason::Aborted);
    // vLLM's parameters are not SGLang's.
    let err = decode
        .generate_with_transfer(
            params(prompt.clone(), 3),
            object(r#"{"do_remote_prefill":true}"#),
        )
        .await
        .unwrap_err();
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unimplemented);

    // A dead prefill engine fails the prefill at once, retryably.
    drop(prefill_fake);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let err = prefill
        .prefill(prefill_params(prompt, Duration::from_secs(5)))
        .await
        .unwrap_err();
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::Unavailable);
    prefill.shutdown();
    decode.shutdown();
}
