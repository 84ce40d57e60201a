//! Sub-agent placement on real-engine workers, end to end through the real binary: a gateway
//! and two `switchyard worker --engine vllm` processes of role `both` in front of stand-in
//! engines with a KV connector (`tests/python/fake_vllm.py --kv-transfer`, `fake_pd.py`).
//!
//! The parent's worker holds its prefix and is saturated (its stand-in holds prefills, so the
//! requests queued there wait); a sub-agent sharing that prefix goes to the free worker, which
//! pulls the prefix's KV from the holder through vLLM's `kv_transfer_params` (the holder
//! prefills the prompt from its cache), so the prefix is counted as transferred on the free
//! engine, not recomputed. When the free worker announced no peer link, the pair cannot
//! exchange KV: it is priced no copy and recomputes the prefix.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::fake_engine::{Fake, explain, overlap};
use support::{Api, Launch, SwitchyardProcess, eventually, tokens};
use switchyard_testkit::EtcdServer;

use crate::engine_pd_e2e::{complete, decisions, sees_workers};

const BLOCK: u64 = 4;
/// The parent's prefix: 16 blocks.
const PREFIX_TOKENS: u32 = 64;
/// Prefill queued on the parent's worker: 3 requests of 80 tokens, held by its engine.
const QUEUED: u32 = 3;

/// What the placement scenario left behind.
struct Placed {
    api: Api,
    holder: Fake,
    free: Fake,
    sub_agent: Value,
    /// The admin explain of the sub-agent's prompt just before it was sent.
    explained: Value,
    _processes: Vec<SwitchyardProcess>,
    _etcd: EtcdServer,
}

/// Runs the scenario; the free worker announces a peer link when `free_announces`.
async fn place_a_sub_agent(free_announces: bool) -> Placed {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("placement-{free_announces}-{}", std::process::id());
    let flags = ["--kv-transfer", "--num-blocks", "1024"];
    let holder = Fake::start(&flags).await;
    let free = Fake::start(&flags).await;
    let worker = |fake: &Fake, id: &str, announces: bool| {
        let launch = fake.worker("vllm", id, &endpoint, &cluster).role("both");
        if announces {
            launch.arg("--kv-peer-gbytes-per-s", "10")
        } else {
            launch
        }
    };
    let holder_worker = worker(&holder, "holder", true).start().await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = Api::new(&gateway);
    sees_workers(&api, &["holder"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The parent's prefix is cached on the holder and indexed there.
    let parent = tokens(1, PREFIX_TOKENS);
    holder.admin("store", json!({"tokens": parent})).await;
    let indexed = eventually(Duration::from_secs(15), || async {
        overlap(&api.base, "holder", &parent).await == u64::from(PREFIX_TOKENS) / BLOCK
    })
    .await;
    assert!(
        indexed,
        "the gateway indexes the parent's prefix on the holder"
    );

    // The parent's worker saturates: its engine holds prefills, and requests queue there
    // (it is the only worker yet).
    holder.admin("hold_prefill", json!({"hold": true})).await;
    let mut queued = Vec::new();
    for k in 0..QUEUED {
        let api = Api::at(&api.base);
        queued.push(tokio::spawn(async move {
            complete(&api, &tokens(100 + k, 80), 2).await
        }));
    }
    let arrived = eventually(Duration::from_secs(15), || async {
        requests(&holder).await.len() >= QUEUED as usize
    })
    .await;
    assert!(arrived, "the queued requests reach the holder's engine");

    // The free worker joins; a sub-agent sharing the parent's prefix arrives.
    let free_worker = worker(&free, "free", free_announces).start().await;
    sees_workers(&api, &["holder", "free"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut prompt = parent.clone();
    prompt.extend(tokens(7, 8));
    let explained = explain(&api.base, &prompt).await;
    let sub_agent = {
        let api = Api::at(&api.base);
        tokio::spawn(async move { complete(&api, &prompt, 4).await })
    };
    if free_announces {
        // The holder is asked to prefill it for a remote decode: it runs from its cache once
        // the engine takes prefills again.
        let asked = eventually(Duration::from_secs(15), || async {
            requests(&holder)
                .await
                .iter()
                .any(|r| r["kv_transfer_params"]["do_remote_decode"] == true)
        })
        .await;
        assert!(asked, "the holder gets the sub-agent's prefill");
    } else {
        let asked = eventually(Duration::from_secs(15), || async {
            !requests(&free).await.is_empty()
        })
        .await;
        assert!(asked, "the free worker gets the sub-agent");
    }
    holder.admin("hold_prefill", json!({"hold": false})).await;
    let (status, sub_agent) = sub_agent.await.unwrap();
    assert_eq!(status, 200, "{sub_agent}");
    for request in queued {
        let (status, body) = request.await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    Placed {
        api,
        holder,
        free,
        sub_agent,
        explained,
        _processes: vec![gateway, holder_worker, free_worker],
        _etcd: etcd,
    }
}

/// The generation requests `fake` received.
async fn requests(fake: &Fake) -> Vec<Value> {
    fake.admin("requests", json!({})).await["requests"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agent_pulls_its_parents_prefix_from_the_saturated_holder() {
    let placed = place_a_sub_agent(true).await;
    let Placed {
        api,
        holder,
        free,
        sub_agent,
        explained,
        ..
    } = &placed;
    assert_eq!(
        explained["disaggregation"]["mode"], "placement",
        "{explained}"
    );
    assert_eq!(sub_agent["usage"]["completion_tokens"], 4);
    // The free engine generated it from the holder's KV: the prefix (and the sub-agent's own
    // two full blocks, which the holder prefilled) transferred, nothing recomputed.
    let transfers = free.admin("transfers", json!({})).await;
    let received = transfers["received"].as_array().unwrap();
    assert_eq!(received.len(), 1, "{transfers}");
    assert_eq!(received[0]["outcome"], "pulled", "{transfers}");
    assert_eq!(received[0]["tokens"], PREFIX_TOKENS + 8, "{transfers}");
    let holder_side = holder.admin("transfers", json!({})).await;
    assert_eq!(holder_side["handed_over"], 1, "{holder_side}");
    assert_eq!(
        received[0]["params"]["remote_engine_id"],
        holder_side["engine_id"]
    );
    assert_eq!(
        api.metric(r#"switchyard_placements_total{outcome="pulled"}"#)
            .await,
        1.0
    );
    // Not a prefill-pool prefill.
    assert_eq!(api.metric("switchyard_disagg_prefills_total").await, 0.0);
    // The decisions say so: decoded on the free worker with the copy priced from the holder,
    // prefilled on the holder as a placement.
    let decode = decisions(api, "decode").await;
    let placed = &decode[0];
    assert_eq!(placed["explanation"]["chosen"], "free", "{placed}");
    assert_eq!(placed["outcome"]["mode"], "placement", "{placed}");
    assert_eq!(placed["outcome"]["prefill_worker"], "holder", "{placed}");
    let free_score = placed["explanation"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker"] == "free")
        .unwrap();
    assert_eq!(
        free_score["onboarding"]["peer_blocks"],
        u64::from(PREFIX_TOKENS) / BLOCK,
        "{placed}"
    );
    let prefill = decisions(api, "prefill").await;
    assert_eq!(prefill.len(), 1, "{prefill:?}");
    assert_eq!(prefill[0]["explanation"]["chosen"], "holder");
    // The holder's prefill hit its cache for the whole prefix.
    assert_eq!(
        prefill[0]["outcome"]["realized_cached_tokens"], PREFIX_TOKENS,
        "{prefill:?}"
    );
    assert!(
        prefill[0]["note"]
            .as_str()
            .is_some_and(|n| n.starts_with("placement:")),
        "{prefill:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_that_cannot_exchange_kv_recomputes_the_prefix() {
    let placed = place_a_sub_agent(false).await;
    let Placed {
        api,
        holder,
        free,
        sub_agent,
        explained,
        ..
    } = &placed;
    assert_ne!(
        explained["disaggregation"]["mode"], "placement",
        "{explained}"
    );
    assert_eq!(sub_agent["usage"]["completion_tokens"], 4);
    // Sent to the free worker (the holder is saturated), which recomputed the whole prompt.
    let decode = decisions(api, "decode").await;
    assert_eq!(decode[0]["explanation"]["chosen"], "free", "{}", decode[0]);
    assert_eq!(decode[0]["outcome"]["mode"], "aggregated");
    assert_eq!(
        sub_agent["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{sub_agent}"
    );
    let transfers = free.admin("transfers", json!({})).await;
    assert_eq!(transfers["received"], json!([]), "{transfers}");
    assert_eq!(holder.admin("transfers", json!({})).await["handed_over"], 0);
    assert!(decisions(api, "prefill").await.is_empty());
    assert_eq!(api.metric("switchyard_placements_total").await, 0.0);
}
