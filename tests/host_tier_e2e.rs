//! Host-tier routing end to end, per engine (issue 44, item 1): a worker whose prompt prefix
//! moved from device to host memory is still preferred over recomputing the prefix when the
//! host link it announced makes loading cheaper, and not when loading costs more.
//!
//! Through the real binary: an etcd, a gateway and three `switchyard worker` processes over
//! loopback, for each engine flavour in turn. Worker `fast` announces a 25 GB/s host link,
//! worker `slow` a 0.1 GB/s one, both 16,000 prefill tokens/s; `cold` holds nothing. Each of
//! `fast` and `slow` has its own 16-block prefix moved to host memory, announced as its engine
//! announces it:
//!
//! - vLLM 0.33.0 and SGLang 0.5.23: by the engine's OWN publisher code
//!   (`tests/python/engines/publisher.py`, the releases' `kv_events` modules from their PyPI
//!   wheels, fetched by `tests/python/engines/fetch.py`), which the worker follows over ZMQ: the
//!   prefix stored on the device, stored again in host memory (vLLM's offloading connector:
//!   medium `CPU`; SGLang's HiCache write-through, through its `KVCacheEventRecorder`: medium
//!   `CPU_PINNED`), then removed from the device. The worker's HTTP engine is the stand-in
//!   (`fake_vllm.py`), which serves the request.
//! - TensorRT-LLM: the `trtllm-serve` stand-in (`fake_trtllm.py --host-blocks`), whose block
//!   manager offloads blocks evicted from its primary pool to its secondary one and announces
//!   each move as TensorRT-LLM does (`updated`, `cache_level` 0 → 1); the worker polls them.
//!
//! Then, per flavour: the prompt extending `fast`'s prefix goes to `fast`, its decision showing
//! the 16 blocks as host hits loaded faster than recomputed; the prompt extending `slow`'s
//! prefix does not go to `slow`, whose host hits are priced above recomputing them. If the tier
//! were lost (host blocks scored as device hits) or the tier cost dropped, `slow` would win.

use crate::support;

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_engine::{Fake, explain};
use support::fake_trtllm::FakeTrtllm;
use support::{Api, Launch, SwitchyardProcess, tokens};
use switchyard_testkit::EtcdServer;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::engine_pd_e2e::{complete, decisions, sees_workers};

const BLOCK: u32 = 4;
/// The prefix moved to host memory: 16 blocks.
const PREFIX_TOKENS: u32 = 64;
const PREFIX_BLOCKS: u64 = (PREFIX_TOKENS / BLOCK) as u64;
/// The request's own tokens past the prefix (uncached everywhere).
const SUFFIX_TOKENS: u32 = 8;
const PREFILL_TOKENS_PER_S: &str = "16000";
/// Host links: loading 16 blocks (8 MiB at the workers' 512 KiB per block) takes about 0.4 ms
/// at 25 GB/s, 84 ms at 0.1 GB/s; recomputing their 64 tokens takes 4 ms.
const FAST_HOST_GBPS: &str = "25";
const SLOW_HOST_GBPS: &str = "0.1";
const PUBLISHER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/python/engines/publisher.py"
);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavour {
    Vllm,
    Sglang,
    Trtllm,
}

impl Flavour {
    fn engine(self) -> &'static str {
        match self {
            Flavour::Vllm => "vllm",
            Flavour::Sglang => "sglang",
            Flavour::Trtllm => "trtllm",
        }
    }
}

/// A release's own KV-event publisher (`publisher.py`, one data-parallel rank), driven one
/// step per stdin line.
struct OwnPublisher {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    pub_port: u64,
    replay_port: u64,
}

impl OwnPublisher {
    async fn start(flavour: Flavour) -> OwnPublisher {
        let version = match flavour {
            Flavour::Vllm => "0.33.0",
            Flavour::Sglang => "0.5.23",
            Flavour::Trtllm => unreachable!("TensorRT-LLM's events are polled from its server"),
        };
        let mut child = Command::new("python3")
            .arg(PUBLISHER)
            .args(["--engine", flavour.engine(), "--version", version])
            .args(["--dp-ranks", "1", "--script", "-", "--page-size", "4"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs publisher.py");
        let stdin = child.stdin.take().expect("stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("publisher starts")
            .expect("read publisher stdout")
            .unwrap_or_else(|| {
                panic!(
                    "{} {version}'s publisher exited (its modules: python3 tests/python/engines/fetch.py)",
                    flavour.engine()
                )
            });
        let ready: Value =
            serde_json::from_str(line.strip_prefix("READY ").expect("READY line")).expect("json");
        OwnPublisher {
            _child: child,
            stdin,
            lines,
            pub_port: ready["pub_ports"][0].as_u64().expect("pub port"),
            replay_port: ready["replay_ports"][0].as_u64().expect("replay port"),
        }
    }

    /// Runs one step and waits until the publisher has sent it (`PUBLISHED`) or answered it.
    async fn step(&mut self, step: Value) {
        let line = format!("{step}\n");
        self.stdin.write_all(line.as_bytes()).await.expect("write");
        self.stdin.flush().await.expect("flush");
        let answer = tokio::time::timeout(Duration::from_secs(30), self.lines.next_line())
            .await
            .expect("publisher answers")
            .expect("read")
            .expect("publisher alive");
        assert!(
            answer.starts_with("PUBLISHED") || answer.starts_with("OK"),
            "{step} -> {answer}"
        );
    }

    /// One batch of `events` from the engine's scheduler.
    async fn batch(&mut self, events: Value) {
        self.step(json!({"rank": 0, "events": events})).await;
    }
}

/// The stand-in serving a worker's engine API.
enum StandIn {
    Zmq(Fake),
    Trtllm(FakeTrtllm),
}

/// One engine behind a worker: its stand-in and, for vLLM and SGLang holders, the release's
/// own publisher announcing its KV events.
struct Engine {
    flavour: Flavour,
    stand_in: StandIn,
    publisher: Option<OwnPublisher>,
}

impl Engine {
    /// An engine whose KV events announce a host tier.
    async fn holder(flavour: Flavour) -> Engine {
        let (stand_in, publisher) = match flavour {
            Flavour::Trtllm => {
                // A primary pool smaller than the prefix plus the filler that evicts it.
                let fake = FakeTrtllm::start(&["--num-blocks", "20", "--host-blocks", "64"]).await;
                (StandIn::Trtllm(fake), None)
            }
            _ => {
                let fake = Fake::start(&["--flavor", flavour.engine()]).await;
                (StandIn::Zmq(fake), Some(OwnPublisher::start(flavour).await))
            }
        };
        Engine {
            flavour,
            stand_in,
            publisher,
        }
    }

    /// An engine holding nothing, announcing its own (device) events.
    async fn cold(flavour: Flavour) -> Engine {
        let stand_in = match flavour {
            Flavour::Trtllm => StandIn::Trtllm(FakeTrtllm::start(&[]).await),
            _ => StandIn::Zmq(Fake::start(&["--flavor", flavour.engine()]).await),
        };
        Engine {
            flavour,
            stand_in,
            publisher: None,
        }
    }

    /// `switchyard worker` in front of this engine, following its events.
    fn worker(&self, id: &str, etcd: &str, cluster: &str) -> Launch {
        let launch = match (&self.stand_in, &self.publisher) {
            (StandIn::Trtllm(fake), _) => fake.worker(id, etcd, cluster),
            (StandIn::Zmq(fake), None) => fake.worker(self.flavour.engine(), id, etcd, cluster),
            (StandIn::Zmq(fake), Some(publisher)) => Launch::worker(etcd, cluster)
                .arg("--engine", self.flavour.engine())
                .arg("--engine-url", &fake.http)
                .arg(
                    "--kv-events",
                    &format!("tcp://127.0.0.1:{}", publisher.pub_port),
                )
                .arg(
                    "--kv-replay",
                    &format!("tcp://127.0.0.1:{}", publisher.replay_port),
                )
                .arg("--model", "fake-model")
                .id(id),
        };
        launch.arg("--kv-prefill-tokens-per-s", PREFILL_TOKENS_PER_S)
    }

    /// Moves `prefix` from the device to host memory, as the engine does and announces it.
    async fn move_to_host(&mut self, prefix: &[u32], filler: &[u32]) {
        let bs = BLOCK;
        let blocks: Vec<u32> = (0..prefix.len() as u32 / bs).collect();
        match (&self.stand_in, self.publisher.as_mut()) {
            (StandIn::Trtllm(fake), _) => {
                // Cached by a request, then evicted from the primary pool (offloaded) by the
                // next request's blocks.
                fake.admin("store", json!({"tokens": prefix})).await;
                fake.admin("store", json!({"tokens": filler})).await;
                let state = fake.admin("state", json!({})).await;
                assert_eq!(
                    state["host"].as_array().map(Vec::len),
                    Some(PREFIX_BLOCKS as usize),
                    "{state}"
                );
            }
            (StandIn::Zmq(_), Some(p)) => {
                let steps = if self.flavour == Flavour::Vllm {
                    // Computed on the device (BlockPool), stored to CPU by the offloading
                    // connector, then evicted from the device block by block.
                    let seq = json!({"type": "StoreSeq", "tokens": prefix, "block_size": bs});
                    let mut offloaded = seq.clone();
                    offloaded["medium"] = json!("CPU");
                    let evicted = json!({"type": "RemoveSeq", "tokens": prefix,
                                         "block_size": bs, "blocks": blocks, "medium": "GPU"});
                    [seq, offloaded, evicted]
                } else {
                    // A radix node on the device, backed up to host memory (HiCache
                    // write-through), then evicted from the device.
                    let node = |id: &str, medium: &str| {
                        json!({"type": "StoreNode", "id": id, "parent": null,
                               "tokens": prefix, "medium": medium})
                    };
                    let evicted = json!({"type": "RemoveNode", "id": "dev", "medium": "GPU"});
                    [node("dev", "GPU"), node("host", "CPU_PINNED"), evicted]
                };
                for event in steps {
                    p.batch(json!([event])).await;
                }
            }
            (StandIn::Zmq(_), None) => unreachable!("a holder has its publisher"),
        }
    }

    /// Nudges a ZMQ subscriber that may have joined after the last batch: an empty batch whose
    /// sequence number shows a gap it repairs through the replay socket.
    async fn probe(&mut self) {
        if let Some(p) = self.publisher.as_mut() {
            p.step(json!({"rank": 0, "probe": true})).await;
        }
    }

    /// Whether the stand-in received a generation request for `prompt`.
    async fn served(&self, prompt: &[u32]) -> bool {
        let requests = match &self.stand_in {
            StandIn::Zmq(fake) => fake.admin("requests", json!({})).await,
            StandIn::Trtllm(fake) => fake.admin("requests", json!({})).await,
        };
        let prompt = json!(prompt);
        requests["requests"]
            .as_array()
            .expect("requests")
            .iter()
            .any(|r| r["prompt"] == prompt || r["input_ids"] == prompt)
    }
}

/// The score of `worker` in an explanation.
fn score<'a>(explanation: &'a Value, worker: &str) -> &'a Value {
    explanation["workers"]
        .as_array()
        .unwrap_or_else(|| panic!("no workers in {explanation}"))
        .iter()
        .find(|w| w["worker"] == worker)
        .unwrap_or_else(|| panic!("{worker} not in {explanation}"))
}

/// `holder`'s prefix is scored as host blocks, priced with the host link it announced.
fn assert_host_hits(explanation: &Value, holder: &str, gbytes_per_s: &str, what: &str) {
    let s = score(explanation, holder);
    assert_eq!(s["overlap"]["device"], 0, "{what}: {s}");
    assert_eq!(s["overlap"]["device_or_host"], PREFIX_BLOCKS, "{what}: {s}");
    let onboarding = &s["onboarding"];
    assert_eq!(onboarding["host_blocks"], PREFIX_BLOCKS, "{what}: {s}");
    assert_eq!(onboarding["announced"], true, "{what}: {s}");
    let rate: f64 = gbytes_per_s.parse().unwrap();
    assert_eq!(
        onboarding["costs"]["host"]["bytes_per_s"].as_f64(),
        Some(rate * 1e9),
        "{what}: {s}"
    );
}

fn seconds(s: &Value, key: &str) -> f64 {
    s["onboarding"][key].as_f64().expect("seconds")
}

/// Case 1: the fast holder's host hits load faster than recomputing; it is chosen.
fn assert_loaded_from_host(explanation: &Value, what: &str) {
    assert_host_hits(explanation, "fast", FAST_HOST_GBPS, what);
    let fast = score(explanation, "fast");
    assert!(
        seconds(fast, "seconds") < seconds(fast, "recompute_seconds"),
        "{what}: {fast}"
    );
    assert_eq!(explanation["chosen"], "fast", "{what}: {explanation}");
}

/// Case 2: the slow holder's host hits cost more than recomputing; a worker that recomputes
/// the prompt is chosen.
fn assert_recomputed(explanation: &Value, what: &str) {
    assert_host_hits(explanation, "slow", SLOW_HOST_GBPS, what);
    let slow = score(explanation, "slow");
    assert!(
        seconds(slow, "seconds") > seconds(slow, "recompute_seconds"),
        "{what}: {slow}"
    );
    let chosen = explanation["chosen"].as_str().expect("chosen");
    assert_ne!(chosen, "slow", "{what}: {explanation}");
    let winner = score(explanation, chosen);
    assert_eq!(winner["overlap"]["any_tier"], 0, "{what}: {winner}");
    assert!(
        slow["score"].as_f64().unwrap() > winner["score"].as_f64().unwrap(),
        "{what}: {explanation}"
    );
}

/// The newest routing decision the gateway logged.
async fn last_decision(api: &Api) -> Value {
    decisions(api, "decode")
        .await
        .into_iter()
        .next()
        .expect("a decision")
}

async fn host_tier_routes_on_the_announced_cost(flavour: Flavour) {
    let what = flavour.engine();
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("host-tier-{what}-{}", std::process::id());
    let mut fast = Engine::holder(flavour).await;
    let mut slow = Engine::holder(flavour).await;
    let cold = Engine::cold(flavour).await;
    let _workers = [
        fast.worker("fast", &endpoint, &cluster)
            .arg("--kv-host-gbytes-per-s", FAST_HOST_GBPS)
            .start()
            .await,
        slow.worker("slow", &endpoint, &cluster)
            .arg("--kv-host-gbytes-per-s", SLOW_HOST_GBPS)
            .start()
            .await,
        cold.worker("cold", &endpoint, &cluster).start().await,
    ];
    let gateway: SwitchyardProcess = Launch::gateway(&endpoint, &cluster).start().await;
    let api = Api::new(&gateway);
    sees_workers(&api, &["fast", "slow", "cold"]).await;

    let (fast_prefix, slow_prefix) = (tokens(11, PREFIX_TOKENS), tokens(12, PREFIX_TOKENS));
    fast.move_to_host(&fast_prefix, &tokens(13, 80)).await;
    slow.move_to_host(&slow_prefix, &tokens(14, 80)).await;
    let prompt = |prefix: &[u32], seed| [prefix, &tokens(seed, SUFFIX_TOKENS)[..]].concat();
    let (fast_prompt, slow_prompt) = (prompt(&fast_prefix, 21), prompt(&slow_prefix, 22));

    // Both prefixes indexed in the host tier only.
    for (engine, id, prompt) in [
        (&mut fast, "fast", &fast_prompt),
        (&mut slow, "slow", &slow_prompt),
    ] {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let explained = explain(&api.base, prompt).await;
            let s = score(&explained["decision"]["explanation"], id);
            if s["overlap"]["device"] == 0 && s["overlap"]["device_or_host"] == PREFIX_BLOCKS {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: {id}'s prefix indexed in host memory only: {explained}"
            );
            engine.probe().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // Case 1: loading from host beats recomputing; the holder is chosen and serves it.
    let explained = explain(&api.base, &fast_prompt).await;
    assert_loaded_from_host(&explained["decision"]["explanation"], what);
    let (status, body) = complete(&api, &fast_prompt, 2).await;
    assert_eq!(status, 200, "{what}: {body}");
    let decision = last_decision(&api).await;
    assert_loaded_from_host(&decision["explanation"], what);
    assert!(fast.served(&fast_prompt).await, "{what}: fast serves it");
    // The host blocks are predicted as cached, since the engine loads them back rather than
    // recompute them. Only TensorRT-LLM's stand-in holds the blocks it announced (vLLM's and
    // SGLang's are announced by their own publisher code, apart from the engine that serves),
    // so only there is the realized hit the prediction, with no misprediction flagged.
    assert_eq!(
        decision["predicted_cached_tokens"], PREFIX_TOKENS,
        "{what}: {decision}"
    );
    if flavour == Flavour::Trtllm {
        let outcome = &decision["outcome"];
        assert_eq!(
            outcome["realized_cached_tokens"], PREFIX_TOKENS,
            "{what}: {decision}"
        );
        assert_eq!(outcome["prediction_error_tokens"], 0, "{what}: {decision}");
        assert!(outcome.get("flag").is_none(), "{what}: {decision}");
    }

    // Case 2: loading from host costs more than recomputing; the holder is passed over.
    let explained = explain(&api.base, &slow_prompt).await;
    assert_recomputed(&explained["decision"]["explanation"], what);
    let (status, body) = complete(&api, &slow_prompt, 2).await;
    assert_eq!(status, 200, "{what}: {body}");
    let decision = last_decision(&api).await;
    assert_recomputed(&decision["explanation"], what);
    assert!(
        !slow.served(&slow_prompt).await,
        "{what}: slow is passed over"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_in_host_memory_is_loaded_only_when_cheaper_than_recomputing() {
    for flavour in [Flavour::Vllm, Flavour::Sglang, Flavour::Trtllm] {
        host_tier_routes_on_the_announced_cost(flavour).await;
    }
}
