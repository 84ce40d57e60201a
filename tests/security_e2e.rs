//! The authenticated control plane end to end (issue 22), with real processes: etcd, a prefill
//! and a decode `switchyard worker` and a `switchyard gateway --disaggregation enforce`, first
//! with a cluster secret (TLS off), then with mTLS from a CA made in the test. A request through
//! the gateway is served across both pools (so the decode worker's `PullKv` from the prefill
//! worker is authenticated too), while each attack from a client the test builds by hand is
//! refused: draining or re-roling a worker, `Generate` past the gateway, pinning KV with
//! `Prefill`, pulling KV with `PullKv`, reading the KV events, and a `KvSource.address` that
//! points at something other than a registered worker (which is never dialed, and whose answer
//! could not be echoed anyway). Worker entries forged into etcd without the cluster secret are
//! ignored (and counted) by the gateway and by the workers. Bad security settings exit 64 with
//! one sentence.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use support::{Api, Launch, SwitchyardProcess, refused_at_start, tokens};
use switchyard_proto::v1::{self, worker_client::WorkerClient};
use switchyard_security::ahead::ReadAhead;
use switchyard_security::tls::{Reloading, TlsFiles, grpc_client_config};
use switchyard_security::{AuthChannel, ClusterSecret, Credential, Dialer, Identity, PeerRole};
use switchyard_testkit::EtcdServer;
use switchyard_testkit::certs::TestCa;
use tonic::Code;

const SECRET: &str = "correct-horse-battery-staple-0123456789";

async fn complete(api: &Api, prompt: Vec<u32>) -> (u16, Value) {
    api.post(
        "/v1/completions",
        &json!({"model": "sim-8b", "prompt": prompt, "max_tokens": 4, "ignore_eos": true}),
    )
    .await
}

/// A client of one worker, dialing with `dialer`.
async fn client(dialer: &Dialer, address: &str) -> WorkerClient<AuthChannel> {
    let endpoint = dialer.endpoint(address).unwrap();
    WorkerClient::new(dialer.connect(endpoint).await.unwrap())
}

/// A plain-text client presenting `secret`'s credential as `role` (no secret: no credential).
async fn secret_client(
    cluster: &str,
    role: PeerRole,
    secret: Option<&str>,
    address: &str,
) -> WorkerClient<AuthChannel> {
    let secret = secret.map(|s| ClusterSecret::from_bytes(s.as_bytes()).unwrap());
    let dialer = Dialer::new(Credential::new(Identity::new(cluster, role), secret), None);
    client(&dialer, address).await
}

fn drain() -> v1::ControlRequest {
    v1::ControlRequest {
        command: Some(v1::control_request::Command::Drain(v1::Drain {
            wait_ms: 0,
        })),
    }
}

fn generate(kv_source: Option<v1::KvSource>) -> v1::GenerateRequest {
    v1::GenerateRequest {
        priority: None,
        request_id: "intruder".into(),
        prompt_token_ids: tokens(9, 64),
        sampling: Some(v1::SamplingParams {
            max_tokens: 2,
            ..Default::default()
        }),
        kv_source,
        identity: None,
        retention: None,
    }
}

fn prefill() -> v1::PrefillRequest {
    v1::PrefillRequest {
        priority: None,
        request_id: "pin".into(),
        prompt_token_ids: tokens(10, 256),
        hold_ms: 600_000,
        pipelined: false,
        identity: None,
        retention: None,
        sampling: None,
    }
}

fn pull() -> v1::PullKvRequest {
    v1::PullKvRequest {
        handle: Some(v1::KvHandle { id: "guess".into() }),
        blocks_per_chunk: 0,
    }
}

/// Every call an outsider or a member in the wrong role might try, with the code each must
/// get from the worker (`decode` for calls a decode worker serves, `prefill` for the others).
async fn assert_refused(
    mut decode: WorkerClient<AuthChannel>,
    mut prefill_worker: WorkerClient<AuthChannel>,
    expect: &[(&str, Code)],
) {
    for (call, code) in expect {
        let got = match *call {
            "Control" => decode.control(drain()).await.map(drop),
            "Generate" => decode.generate(generate(None)).await.map(drop),
            "Prefill" => prefill_worker.prefill(prefill()).await.map(drop),
            "PullKv" => prefill_worker.pull_kv(pull()).await.map(drop),
            "KvEvents" => decode
                .kv_events(v1::KvEventsRequest::default())
                .await
                .map(drop),
            other => panic!("no such call {other}"),
        };
        let status = got.expect_err(call);
        assert_eq!(status.code(), *code, "{call}: {status:?}");
    }
}

/// Whether the worker at `address` is draining, asked as a member.
async fn draining(dialer: &Dialer, address: &str) -> bool {
    client(dialer, address)
        .await
        .info(v1::InfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .draining
}

/// A TCP service that is not a worker: it greets whoever connects with a banner (what an
/// attacker would like to read back through the worker's error) and counts connections.
async fn bystander() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut socket, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            let _ = socket.write_all(b"SSH-2.0-SECRET-BANNER\r\n").await;
        }
    });
    (address, accepted)
}

/// A `Generate` naming the bystander as its KV source is refused, the bystander never hears
/// from the worker, and nothing of it shows in the error.
async fn assert_foreign_source_refused(mut decode: WorkerClient<AuthChannel>) {
    let (address, accepted) = bystander().await;
    let source = v1::KvSource {
        address: address.clone(),
        handle: Some(v1::KvHandle { id: "h".into() }),
        first_token_id: 1,
        ..Default::default()
    };
    let status = decode.generate(generate(Some(source))).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("not a registered worker"),
        "{status:?}"
    );
    assert!(!status.message().contains("SECRET"), "{status:?}");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        0,
        "the worker dialed the bystander"
    );
}

/// Starts the two workers and the gateway of one cluster with the same security flags.
async fn cluster(
    etcd: &str,
    cluster: &str,
    flags: impl Fn(&str) -> Vec<String>,
) -> (SwitchyardProcess, SwitchyardProcess, SwitchyardProcess) {
    let worker = |id: &'static str, role: &'static str| {
        Launch::worker(etcd, cluster)
            .arg("--speedup", "20")
            .arg("--max-context", "8192")
            .role(role)
            .id(id)
            .args(flags("worker"))
            .start()
    };
    let prefill = worker("prefill-a", "prefill").await;
    let decode = worker("decode-a", "decode").await;
    let gateway = Launch::gateway(etcd, cluster)
        .arg("--disaggregation", "enforce")
        .args(flags("gateway"))
        .start()
        .await;
    (prefill, decode, gateway)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_cluster_secret_only_members_in_their_roles_get_in() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let name = format!("secret-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).unwrap();
    let secret_path = secret_file.to_str().unwrap().to_owned();
    let (prefill, decode, gateway) = cluster(&endpoint, &name, |_| {
        vec!["--cluster-secret-file".into(), secret_path.clone()]
    })
    .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(2).await, "the gateway sees both workers");

    // Members serve end to end: the gateway prefills on one worker, the other pulls the KV.
    let (status, body) = complete(&api, tokens(1, 1024)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 4);
    assert_eq!(
        api.metric(r#"switchyard_disagg_prefills_total"#).await,
        1.0,
        "served disaggregated"
    );

    // Someone who can write etcd but has no secret registers a "worker" at an address of their
    // choosing: unsigned, and signed with another secret. Gateways and workers ignore both,
    // count them, and the decode worker will not take it as a KV source either.
    let (trap, trapped) = bystander().await;
    let forged = |id: &str| switchyard_core::WorkerInfo {
        id: switchyard_core::WorkerId::new(id).unwrap(),
        address: trap.clone(),
        model: "sim-8b".into(),
        role: switchyard_core::Role::Both,
        block_size: switchyard_core::BlockSize::new(16).unwrap(),
        kv_capacity_blocks: 1 << 20,
        max_context_tokens: 8192,
        engine: switchyard_core::EngineKind::Sim,
        incarnation: 1,
        adapters: Vec::new(),
        engine_endpoint: None,
        kv_tiers: None,
        kv_peer: None,
    };
    let unsigned =
        switchyard_registry::EtcdRegistry::connect(std::slice::from_ref(&endpoint), &name)
            .await
            .unwrap();
    let other_secret = switchyard_registry::EtcdAuth {
        proof: Some(Arc::new(
            ClusterSecret::from_bytes(b"a-secret-that-is-not-the-clusters").unwrap(),
        )),
        ..Default::default()
    };
    let wrongly_signed = switchyard_registry::EtcdRegistry::connect_with(
        std::slice::from_ref(&endpoint),
        &name,
        &other_secret,
    )
    .await
    .unwrap();
    use switchyard_registry::Registry as _;
    let ttl = std::time::Duration::from_secs(30);
    let _forged_a = unsigned.register(forged("forged-a"), ttl).await.unwrap();
    let _forged_b = wrongly_signed
        .register(forged("forged-b"), ttl)
        .await
        .unwrap();
    assert!(
        support::eventually(std::time::Duration::from_secs(10), || async {
            api.metric("switchyard_registry_unverified_entries").await >= 2.0
        })
        .await,
        "the gateway counted the forged entries"
    );
    assert!(api.lists_workers(2).await, "forged workers are not listed");
    for i in 0..6 {
        let (status, body) = complete(&api, tokens(20 + i, 1024)).await;
        assert_eq!(status, 200, "{body}");
    }
    let mut d = secret_client(&name, PeerRole::Gateway, Some(SECRET), &decode.address).await;
    let source = v1::KvSource {
        address: trap.clone(),
        handle: Some(v1::KvHandle { id: "h".into() }),
        first_token_id: 1,
        ..Default::default()
    };
    let status = d.generate(generate(Some(source))).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert_eq!(
        trapped.load(Ordering::SeqCst),
        0,
        "something dialed the forged worker"
    );

    let calls = ["Control", "Generate", "Prefill", "PullKv", "KvEvents"];
    // No credential, or one made with another secret: unauthenticated.
    for secret in [None, Some("not-the-cluster-secret-at-all")] {
        assert_refused(
            secret_client(&name, PeerRole::Planner, secret, &decode.address).await,
            secret_client(&name, PeerRole::Planner, secret, &prefill.address).await,
            &calls.map(|c| (c, Code::Unauthenticated)),
        )
        .await;
    }
    // The right secret for another cluster: unauthenticated (the cluster is in the proof).
    assert_refused(
        secret_client(
            "elsewhere",
            PeerRole::Planner,
            Some(SECRET),
            &decode.address,
        )
        .await,
        secret_client(
            "elsewhere",
            PeerRole::Planner,
            Some(SECRET),
            &prefill.address,
        )
        .await,
        &[("Control", Code::Unauthenticated)],
    )
    .await;
    // Members in the wrong role: a gateway may not drain or pull, a planner may not generate
    // or prefill, a worker may not generate.
    let as_role = |role| {
        let (name, decode, prefill) = (&name, &decode.address, &prefill.address);
        async move {
            (
                secret_client(name, role, Some(SECRET), decode).await,
                secret_client(name, role, Some(SECRET), prefill).await,
            )
        }
    };
    let (d, p) = as_role(PeerRole::Gateway).await;
    assert_refused(
        d,
        p,
        &[
            ("Control", Code::PermissionDenied),
            ("PullKv", Code::PermissionDenied),
        ],
    )
    .await;
    let (d, p) = as_role(PeerRole::Planner).await;
    assert_refused(
        d,
        p,
        &[
            ("Generate", Code::PermissionDenied),
            ("Prefill", Code::PermissionDenied),
            ("KvEvents", Code::PermissionDenied),
        ],
    )
    .await;
    let (d, p) = as_role(PeerRole::Worker).await;
    assert_refused(
        d,
        p,
        &[
            ("Generate", Code::PermissionDenied),
            ("Control", Code::PermissionDenied),
        ],
    )
    .await;

    // A gateway's credential cannot make the decode worker dial an arbitrary address.
    let (d, _) = as_role(PeerRole::Gateway).await;
    assert_foreign_source_refused(d).await;

    // Nothing of the above drained anyone, and the cluster still serves.
    let member = Dialer::new(
        Credential::new(
            Identity::new(&name, PeerRole::Worker),
            Some(ClusterSecret::from_bytes(SECRET.as_bytes()).unwrap()),
        ),
        None,
    );
    assert!(!draining(&member, &decode.address).await);
    assert!(!draining(&member, &prefill.address).await);
    let (status, body) = complete(&api, tokens(2, 1024)).await;
    assert_eq!(status, 200, "{body}");
    // The planner's credential does drain (and resume) it: the role is what counts.
    let (mut planner, _) = as_role(PeerRole::Planner).await;
    assert!(
        planner
            .control(drain())
            .await
            .unwrap()
            .into_inner()
            .draining
    );
    let resume = v1::ControlRequest {
        command: Some(v1::control_request::Command::Resume(v1::Resume {})),
    };
    assert!(!planner.control(resume).await.unwrap().into_inner().draining);
}

/// Certificate files of `role` (`name.crt`, `name.key`, `ca.crt`) in `dir`.
fn member(ca: &TestCa, dir: &Path, name: &str, cluster: &str, role: &str) -> TlsFiles {
    let files = ca
        .issue(dir, name, Some(&TestCa::identity_uri(cluster, role)))
        .unwrap();
    TlsFiles {
        cert: files.cert,
        key: files.key,
        ca: Some(files.ca),
    }
}

fn tls_flags(files: &TlsFiles) -> Vec<String> {
    let path = |p: &Path| p.to_str().unwrap().to_owned();
    vec![
        "--tls-cert".into(),
        path(&files.cert),
        "--tls-key".into(),
        path(&files.key),
        "--tls-ca".into(),
        path(files.ca.as_ref().unwrap()),
    ]
}

/// A client presenting `files` that accepts workers of `cluster` (whatever its own cert says).
fn cert_dialer(files: &TlsFiles, cluster: &str, role: PeerRole) -> Dialer {
    switchyard_security::install_crypto_provider();
    let for_build = files.clone();
    let cluster_name = cluster.to_owned();
    let tls = Reloading::new("test client", files, move || {
        grpc_client_config(&for_build, &cluster_name)
    })
    .unwrap();
    Dialer::new(
        Credential::none(Identity::new(cluster, role)),
        Some(Arc::new(tls)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_mtls_a_certificate_names_the_role_and_outsiders_get_nothing() {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let name = format!("mtls-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("switchyard test ca").unwrap();
    let workers = member(&ca, dir.path(), "worker", &name, "worker");
    let gateway_files = member(&ca, dir.path(), "gateway", &name, "gateway");
    let (prefill, decode, gateway) = cluster(&endpoint, &name, |role| match role {
        "worker" => tls_flags(&workers),
        _ => tls_flags(&gateway_files),
    })
    .await;
    let api = Api::new(&gateway);
    assert!(api.lists_workers(2).await, "the gateway sees both workers");
    let (status, body) = complete(&api, tokens(1, 1024)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(api.metric("switchyard_disagg_prefills_total").await, 1.0);

    // Plain text to a TLS port: no call gets through at all.
    let plain = Dialer::open(Identity::new(&name, PeerRole::Planner));
    let endpoint_of = |address: &str| plain.endpoint(address).unwrap();
    let status = WorkerClient::new(plain.lazy(endpoint_of(&decode.address)))
        .control(drain())
        .await
        .unwrap_err();
    // The TLS server hangs up on the plain-text HTTP/2 preface: a transport or protocol error
    // on the client's side, never an answer of the worker's.
    assert!(
        std::error::Error::source(&status).is_some(),
        "the worker answered a plain-text call: {status:?}"
    );

    // TLS without a client certificate: the worker answers, but refuses every call.
    let ca_pem = std::fs::read_to_string(workers.ca.as_ref().unwrap()).unwrap();
    let anonymous = |address: &str| {
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&ca_pem))
            .domain_name("localhost");
        let channel = tonic::transport::Endpoint::from_shared(format!("https://{address}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect_lazy();
        AuthChannel::new(
            ReadAhead::new(channel),
            Credential::none(Identity::new(&name, PeerRole::Planner)),
        )
    };
    assert_refused(
        WorkerClient::new(anonymous(&decode.address)),
        WorkerClient::new(anonymous(&prefill.address)),
        &["Control", "Generate", "Prefill", "PullKv", "KvEvents"]
            .map(|c| (c, Code::Unauthenticated)),
    )
    .await;

    // A certificate of this CA for another cluster, and one of a foreign CA: refused.
    let other_cluster = member(&ca, dir.path(), "other", "elsewhere", "planner");
    let other = cert_dialer(&other_cluster, &name, PeerRole::Planner);
    let status = client(&other, &decode.address)
        .await
        .control(drain())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let foreign_dir = tempfile::tempdir().unwrap();
    let foreign_ca = TestCa::new("someone else's ca").unwrap();
    let mut forged = member(&foreign_ca, foreign_dir.path(), "planner", &name, "planner");
    forged.ca = workers.ca.clone();
    let forged = cert_dialer(&forged, &name, PeerRole::Planner);
    let endpoint = forged.endpoint(&decode.address).unwrap();
    let refused = match forged.connect(endpoint).await {
        Err(_) => true,
        Ok(channel) => WorkerClient::new(channel).control(drain()).await.is_err(),
    };
    assert!(refused, "a certificate of a foreign CA drained the worker");

    // The gateway's own certificate: it may generate, not drain, and not name a foreign source.
    let as_gateway = cert_dialer(&gateway_files, &name, PeerRole::Gateway);
    assert_refused(
        client(&as_gateway, &decode.address).await,
        client(&as_gateway, &prefill.address).await,
        &[
            ("Control", Code::PermissionDenied),
            ("PullKv", Code::PermissionDenied),
        ],
    )
    .await;
    assert_foreign_source_refused(client(&as_gateway, &decode.address).await).await;

    // A planner certificate drains; nobody else did.
    let planner_files = member(&ca, dir.path(), "planner", &name, "planner");
    let planner = cert_dialer(&planner_files, &name, PeerRole::Planner);
    let worker_view = cert_dialer(&workers, &name, PeerRole::Worker);
    assert!(!draining(&worker_view, &decode.address).await);
    assert!(
        client(&planner, &decode.address)
            .await
            .control(drain())
            .await
            .unwrap()
            .into_inner()
            .draining
    );
    assert!(draining(&worker_view, &decode.address).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_security_settings_exit_64_with_a_sentence() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("ca").unwrap();
    let gateway_cert = member(&ca, dir.path(), "gateway", "c1", "gateway");
    let short = dir.path().join("short");
    std::fs::write(&short, "tiny\n").unwrap();
    let path = |p: &Path| p.to_str().unwrap().to_owned();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--tls-cert".into(), path(&gateway_cert.cert)],
            "tls_cert, tls_key and tls_ca together",
        ),
        (
            // A worker with a gateway's certificate.
            [
                vec!["--cluster".into(), "c1".into()],
                tls_flags(&gateway_cert),
            ]
            .concat(),
            "spiffe://switchyard/c1/worker",
        ),
        (
            vec!["--cluster-secret-file".into(), path(&short)],
            "at least 16 bytes",
        ),
        (
            vec![
                "--cluster-secret-file".into(),
                path(&dir.path().join("missing")),
            ],
            "cannot read cluster secret file",
        ),
    ];
    for (args, expected) in cases {
        let mut command = vec!["worker".to_string()];
        command.extend(args);
        refused_at_start(&command, expected).await;
    }
    // The same files in the config file's [security] table.
    let config = dir.path().join("worker.toml");
    std::fs::write(
        &config,
        format!("[security]\ncluster_secret_file = {:?}\n", path(&short)),
    )
    .unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["worker", "--config", &path(&config)])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
}
