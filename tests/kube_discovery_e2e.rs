//! Kubernetes-native worker discovery end to end, with no cluster: a stand-in API server
//! (`tests/support/fake_kube.rs`) serves the pods of an InferencePool over loopback HTTP, and
//! real `switchyard worker` processes (no etcd anywhere) are the pods' sidecars. The real
//! gateway and endpoint picker binaries find the workers through the pods: ready pods join
//! routing, a pod that turns unready or is deleted leaves it, and a watch ended with
//! `410 Gone` is followed by a re-list that catches what the stale watch missed.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use crate::support::envoy_proxy;
use crate::support::fake_kube;

use std::collections::BTreeSet;
use std::time::Duration;

use envoy_proxy::{ClientRequest, EnvoyProxy, ProxyConfig};
use fake_kube::{FakeKube, NAMESPACE, pod};
use serde_json::json;
use support::fake_engine::{Fake, assert_mirrored};
use support::{Api, Launch, SwitchyardProcess, eventually, refused_at_start, tokens};

/// A simulated worker with no registry, listening on a free loopback port.
async fn sim_worker(id: &str) -> SwitchyardProcess {
    Launch::new("worker")
        .id(id)
        .arg("--listen", "127.0.0.1:0")
        .arg("--speedup", "50")
        .start()
        .await
}

fn port_of(address: &str) -> u16 {
    address.rsplit(':').next().unwrap().parse().unwrap()
}

/// The workers `/admin/explain` weighs for `prompt`: the ones in routing.
async fn candidates(admin: &Api, model: &str) -> BTreeSet<String> {
    let (_, explain) = admin
        .post(
            "/admin/explain",
            &json!({"model": model, "prompt": tokens(9, 64)}),
        )
        .await;
    explain["decision"]["explanation"]["workers"]
        .as_array()
        .map(|workers| {
            workers
                .iter()
                .filter_map(|w| w["worker"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

async fn routes_exactly(admin: &Api, model: &str, ids: &[&str]) -> bool {
    let want: BTreeSet<String> = ids.iter().map(|s| (*s).to_owned()).collect();
    eventually(Duration::from_secs(15), || async {
        candidates(admin, model).await == want
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_follows_the_pools_pods_through_changes_and_a_relist() {
    let kube = FakeKube::start().await;
    kube.pool("sim-pool", 8000);
    let (a, b, c) = (
        sim_worker("sim-a").await,
        sim_worker("sim-b").await,
        sim_worker("sim-c").await,
    );
    let pod_of = |name: &str, worker: &SwitchyardProcess, ready: bool| {
        pod(
            name,
            "127.0.0.1",
            &[("grpc", port_of(&worker.address))],
            ready,
        )
    };
    kube.put(pod_of("pod-a", &a, true));
    kube.put(pod_of("pod-b", &b, true));
    kube.put(pod_of("pod-c", &c, false));
    // A pod of the selector without the sidecar's port is not a worker.
    kube.put(pod("pod-no-sidecar", "127.0.0.1", &[("http", 9)], true));

    let gateway = Launch::new("gateway")
        .arg("--http", "127.0.0.1:0")
        .arg("--discovery", "kubernetes")
        .arg("--k8s-api-url", &kube.url)
        .arg("--k8s-namespace", NAMESPACE)
        .arg("--k8s-pool", "sim-pool")
        .arg("--k8s-worker-port", "grpc")
        .start()
        .await;
    let admin = Api::new(&gateway);
    // Ready at start means the listed pods' workers are known.
    assert_eq!(
        candidates(&admin, "sim-8b").await,
        ["sim-a", "sim-b"].map(String::from).into()
    );
    // The pool's selector is what the pods were listed and watched with.
    assert!(
        kube.selectors().iter().all(|s| s == "app=engine"),
        "{:?}",
        kube.selectors()
    );
    // Requests are served by the discovered workers (over their sidecars' gRPC).
    for seed in 0..4 {
        let body = json!({"model": "sim-8b", "prompt": tokens(100 + seed, 48), "max_tokens": 2});
        let (status, answer) = admin.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{answer}");
    }
    let (_, decisions) = admin.get("/admin/decisions?limit=4").await;
    for decision in decisions.as_array().unwrap() {
        let chosen = decision["explanation"]["chosen"].as_str().unwrap();
        assert!(["sim-a", "sim-b"].contains(&chosen), "{decision}");
    }

    // A pod turning ready joins; one turning unready leaves; a deleted one leaves.
    kube.put(pod_of("pod-c", &c, true));
    assert!(routes_exactly(&admin, "sim-8b", &["sim-a", "sim-b", "sim-c"]).await);
    kube.put(pod_of("pod-a", &a, false));
    assert!(routes_exactly(&admin, "sim-8b", &["sim-b", "sim-c"]).await);
    kube.delete("pod-b");
    assert!(routes_exactly(&admin, "sim-8b", &["sim-c"]).await);
    let body = json!({"model": "sim-8b", "prompt": tokens(7, 48), "max_tokens": 2});
    let (status, answer) = admin.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let (_, last) = admin.get("/admin/decisions?limit=1").await;
    assert_eq!(last[0]["explanation"]["chosen"], "sim-c", "{last}");

    // While the gateway's watch is stale, pod a comes back and pod c goes, unannounced; the
    // API server then ends the watch with 410 Gone. The re-list finds both changes.
    let lists = kube.lists();
    kube.put_silently(pod_of("pod-a", &a, true));
    kube.put_silently(pod_of("pod-c", &c, false));
    assert_eq!(
        candidates(&admin, "sim-8b").await,
        ["sim-c"].map(String::from).into()
    );
    kube.expire_watches();
    assert!(routes_exactly(&admin, "sim-8b", &["sim-a"]).await);
    assert!(
        kube.lists() > lists,
        "410 Gone made the gateway list the pods again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_loaded_into_a_pods_engine_is_routed_and_one_unloaded_is_dropped() {
    // A pod's sidecar follows its vLLM's adapters; the gateway, finding the pod through the
    // Kubernetes API, asks the sidecar again who it is and so follows them too.
    let kube = FakeKube::start().await;
    let fake = Fake::start(&[]).await;
    let worker = Launch::new("worker")
        .id("vllm-pod")
        .arg("--listen", "127.0.0.1:0")
        .arg("--engine", "vllm")
        .arg("--engine-url", &fake.http)
        .arg("--kv-events", &format!("tcp://127.0.0.1:{}", fake.zmq))
        .arg("--kv-replay", &format!("tcp://127.0.0.1:{}", fake.replay))
        .arg("--model", "fake-model")
        .arg("--engine-adapters-interval-ms", "100")
        .start()
        .await;
    kube.put(pod(
        "engine-0",
        "127.0.0.1",
        &[("sidecar", port_of(&worker.address))],
        true,
    ));
    let gateway = Launch::new("gateway")
        .arg("--http", "127.0.0.1:0")
        .arg("--discovery", "kubernetes")
        .arg("--k8s-api-url", &kube.url)
        .arg("--k8s-namespace", NAMESPACE)
        .arg("--k8s-selector", "app=engine")
        .arg("--k8s-worker-port", "sidecar")
        .arg("--k8s-info-refresh-ms", "200")
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(routes_exactly(&api, "fake-model", &["vllm-pod"]).await);
    let ask = json!({"model": "hot-lora", "prompt": tokens(8, 12), "max_tokens": 2});
    assert_eq!(api.post("/v1/completions", &ask).await.0, 404);

    assert_eq!(fake.lora("hot-lora", Some("/adapters/hot")).await.0, 200);
    assert!(
        eventually(Duration::from_secs(15), || async {
            api.post("/v1/completions", &ask).await.0 == 200
        })
        .await,
        "the adapter loaded on the pod's engine is routed"
    );
    assert_eq!(fake.lora("hot-lora", None).await.0, 200);
    assert!(
        eventually(Duration::from_secs(15), || async {
            api.post("/v1/completions", &ask).await.0 == 404
        })
        .await,
        "an adapter unloaded from the pod's engine is no longer routed"
    );
    // The worker stays in routing for its base model throughout.
    assert!(routes_exactly(&api, "fake-model", &["vllm-pod"]).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_answers_with_the_pods_engine_endpoints() {
    let kube = FakeKube::start().await;
    let fake_a = Fake::start(&[]).await;
    let fake_b = Fake::start(&[]).await;
    let engine_port = |fake: &Fake| port_of(&fake.http);
    let sidecar = |fake: &Fake, id: &str| {
        Launch::new("worker")
            .id(id)
            .arg("--listen", "127.0.0.1:0")
            .arg("--engine", "vllm")
            .arg("--engine-url", &fake.http)
            .arg("--kv-events", &format!("tcp://127.0.0.1:{}", fake.zmq))
            .arg("--kv-replay", &format!("tcp://127.0.0.1:{}", fake.replay))
            .arg("--model", "fake-model")
            .start()
    };
    let worker_a = sidecar(&fake_a, "vllm-a").await;
    let worker_b = sidecar(&fake_b, "vllm-b").await;
    let pod_of = |name: &str, fake: &Fake, worker: &SwitchyardProcess| {
        pod(
            name,
            "127.0.0.1",
            &[
                ("http", engine_port(fake)),
                ("sidecar", port_of(&worker.address)),
            ],
            true,
        )
    };
    kube.put(pod_of("engine-a", &fake_a, &worker_a));
    kube.put(pod_of("engine-b", &fake_b, &worker_b));

    let picker = Launch::new("epp")
        .arg("--http", "127.0.0.1:0")
        .arg("--grpc", "127.0.0.1:0")
        .arg("--discovery", "kubernetes")
        .arg("--k8s-api-url", &kube.url)
        .arg("--k8s-namespace", NAMESPACE)
        .arg("--k8s-selector", "app=engine")
        .arg("--k8s-worker-port", "sidecar")
        .arg("--k8s-engine-port", "http")
        .start()
        .await;
    let api = format!("http://{}", picker.address);
    let admin = Api::new(&picker);
    assert!(routes_exactly(&admin, "fake-model", &["vllm-a", "vllm-b"]).await);

    // A prefix engine b holds goes to b's pod, with a's as the fallback.
    let on_b = tokens(43, 64);
    fake_b.admin("store", json!({"tokens": on_b})).await;
    assert_mirrored(&api, "vllm-b", &fake_b).await;
    let (at_a, at_b) = (
        format!("127.0.0.1:{}", engine_port(&fake_a)),
        format!("127.0.0.1:{}", engine_port(&fake_b)),
    );
    let proxy = EnvoyProxy::new(
        picker.ready["grpc"].as_str().unwrap(),
        ProxyConfig::default(),
    );
    let prompt = [on_b.clone(), tokens(5, 8)].concat();
    let request = |id: &str| {
        ClientRequest::post(
            "/v1/completions",
            &json!({"model": "fake-model", "prompt": prompt, "max_tokens": 4, "ignore_eos": true}),
        )
        .header("x-request-id", id)
    };
    let outcome = proxy.send(request("k8s-1")).await;
    assert_eq!(outcome.status, 200, "{outcome:?}");
    assert_eq!(outcome.destination, [at_b.clone(), at_a.clone()]);
    assert_eq!(outcome.served.as_ref(), Some(&at_b));

    // Pod b is deleted: the picker no longer names it, though its engine still holds the
    // prefix and its sidecar still runs.
    kube.delete("engine-b");
    assert!(routes_exactly(&admin, "fake-model", &["vllm-a"]).await);
    let outcome = proxy.send(request("k8s-2")).await;
    assert_eq!(outcome.status, 200, "{outcome:?}");
    assert_eq!(outcome.destination, std::slice::from_ref(&at_a));
    assert_eq!(outcome.served.as_ref(), Some(&at_a));
}

#[tokio::test]
async fn discovery_settings_are_checked_at_start() {
    for (args, says) in [
        (&["gateway"][..], "--etcd"),
        (
            &[
                "gateway",
                "--discovery",
                "kubernetes",
                "--k8s-worker-port",
                "grpc",
            ][..],
            "--k8s-selector",
        ),
        (
            &["epp", "--discovery", "kubernetes", "--k8s-pool", "p"][..],
            "--k8s-worker-port",
        ),
        (
            &[
                "gateway",
                "--discovery",
                "kubernetes",
                "--k8s-pool",
                "p",
                "--k8s-worker-port",
                "0",
            ][..],
            "--k8s-worker-port",
        ),
        (
            &[
                "gateway",
                "--discovery",
                "both",
                "--k8s-selector",
                "a=b",
                "--k8s-worker-port",
                "7000",
            ][..],
            "--etcd",
        ),
    ] {
        refused_at_start(args, says).await;
    }
}
