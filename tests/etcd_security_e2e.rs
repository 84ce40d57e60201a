//! etcd with TLS, client certificates and users (issue 22), end to end: a real etcd whose client
//! port speaks TLS only and wants a certificate of the test CA, with authentication enabled;
//! a worker and a gateway given the CA, a client certificate and a user serve a request through
//! it, while a registry client without the user, with a wrong password, without a client
//! certificate, or in plain text is refused. `switchyard etcd-auth` (the chart's Job) makes a
//! member user limited to the cluster's prefix, twice without harm, following a new password.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use serde_json::json;
use support::{Api, Launch, tokens};
use switchyard_registry::{EtcdAuth, EtcdRegistry, Registry as _};
use switchyard_testkit::certs::TestCa;
use switchyard_testkit::{EtcdServer, EtcdTls};

const PASSWORD: &str = "etcd-root-password-0123";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_etcd_with_users_serves_members_and_refuses_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("etcd test ca").unwrap();
    let server = ca.issue(dir.path(), "etcd-server", None).unwrap();
    let client = ca.issue(dir.path(), "etcd-client", None).unwrap();
    let etcd = EtcdServer::start_tls(EtcdTls {
        cert: server.cert.clone(),
        key: server.key.clone(),
        ca: server.ca.clone(),
    })
    .expect("etcd with tls");
    let endpoint = etcd.endpoint();
    assert!(endpoint.starts_with("https://"), "{endpoint}");
    let read = |p: &std::path::Path| std::fs::read(p).unwrap();
    let tls_only = EtcdAuth {
        ca_pem: Some(read(&client.ca)),
        identity_pem: Some((read(&client.cert), read(&client.key))),
        ..EtcdAuth::default()
    };

    // Turn etcd's authentication on: a root user, then auth enable.
    enable_auth(&endpoint, &client).await;
    let cluster = format!("etcd-sec-{}", std::process::id());
    let member = EtcdAuth {
        user: Some(("root".into(), PASSWORD.into())),
        ..tls_only.clone()
    };
    let endpoints = [endpoint.clone()];
    let registry = EtcdRegistry::connect_with(&endpoints, &cluster, &member)
        .await
        .expect("a member connects");
    assert!(registry.list_workers().await.unwrap().is_empty());

    // Without the user, with a wrong password, without a client certificate, in plain text.
    let wrong_password = EtcdAuth {
        user: Some(("root".into(), "not-the-password".into())),
        ..tls_only.clone()
    };
    let no_client_cert = EtcdAuth {
        identity_pem: None,
        ..member.clone()
    };
    let plain = [endpoint.replacen("https://", "http://", 1)];
    for (what, endpoints, auth) in [
        ("no user", &endpoints, &tls_only),
        ("wrong password", &endpoints, &wrong_password),
        ("no client certificate", &endpoints, &no_client_cert),
    ] {
        let refused = match EtcdRegistry::connect_with(endpoints, &cluster, auth).await {
            Err(_) => true,
            Ok(intruder) => intruder.list_workers().await.is_err(),
        };
        assert!(refused, "{what}: etcd let it in");
    }
    let user_only = EtcdAuth {
        user: member.user.clone(),
        ..EtcdAuth::default()
    };
    assert!(
        EtcdRegistry::connect_with(&plain, &cluster, &user_only)
            .await
            .is_err(),
        "plain text reached the TLS port"
    );

    // The processes, given the CA, the certificate and the user, serve through it.
    let password_file = dir.path().join("etcd-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let etcd_flags = [
        "--etcd-username".to_owned(),
        "root".to_owned(),
        "--etcd-password-file".to_owned(),
        path(&password_file),
        "--etcd-ca".to_owned(),
        path(&client.ca),
        "--etcd-cert".to_owned(),
        path(&client.cert),
        "--etcd-key".to_owned(),
        path(&client.key),
    ];
    let _worker = Launch::worker(&endpoint, &cluster)
        .arg("--speedup", "20")
        .args(&etcd_flags)
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .args(&etcd_flags)
        .start()
        .await;
    let api = Api::new(&gateway);
    assert!(
        api.lists_workers(1).await,
        "the gateway found the worker in etcd"
    );
    let (status, body) = api
        .post(
            "/v1/completions",
            &json!({"model": "sim-8b", "prompt": tokens(1, 64), "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(registry.list_workers().await.unwrap().len(), 1);
}

/// Runs `switchyard etcd-auth` with `args`; its exit code, stdout and stderr.
async fn etcd_auth(args: &[String]) -> (Option<i32>, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("etcd-auth")
        .args(args)
        .output()
        .await
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_auth_limits_the_members_user_to_its_cluster_and_runs_again_harmlessly() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("etcd auth test ca").unwrap();
    let server = ca.issue(dir.path(), "etcd-server", None).unwrap();
    // etcd takes a client certificate's common name as the user: this one acts as root.
    let root = ca.issue(dir.path(), "root", None).unwrap();
    let member = ca.issue(dir.path(), "switchyard", None).unwrap();
    let etcd = EtcdServer::start_tls(EtcdTls {
        cert: server.cert.clone(),
        key: server.key.clone(),
        ca: server.ca.clone(),
    })
    .expect("etcd with tls");
    let endpoint = etcd.endpoint();
    let cluster = format!("etcd-auth-{}", std::process::id());
    let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let password_file = dir.path().join("member-password");
    std::fs::write(&password_file, "first-password-0123\n").unwrap();
    let args: Vec<String> = [
        "--etcd",
        &endpoint,
        "--cluster",
        &cluster,
        "--user-password-file",
        &path(&password_file),
        "--etcd-ca",
        &path(&root.ca),
        "--etcd-cert",
        &path(&root.cert),
        "--etcd-key",
        &path(&root.key),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();

    let (code, stdout, stderr) = etcd_auth(&args).await;
    assert_eq!(code, Some(0), "{stderr}");
    let done: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        done["created"],
        json!(["role:switchyard", "user:root", "user:switchyard"])
    );
    // Again, with authentication on and a new password: nothing created, the password follows.
    std::fs::write(&password_file, "second-password-0123\n").unwrap();
    let (code, stdout, stderr) = etcd_auth(&args).await;
    assert_eq!(code, Some(0), "{stderr}");
    let done: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(done["created"], json!([]));

    let read = |p: &std::path::Path| std::fs::read(p).unwrap();
    let tls = || etcd_tls(&member);
    let login = |password: &'static str| {
        etcd_client::ConnectOptions::new()
            .with_tls(tls())
            .with_user("switchyard", password)
    };
    assert!(
        etcd_client::Client::connect([endpoint.as_str()], Some(login("first-password-0123")))
            .await
            .is_err(),
        "the old password still works"
    );
    let mut client =
        etcd_client::Client::connect([endpoint.as_str()], Some(login("second-password-0123")))
            .await
            .expect("the member user logs in");
    let inside = format!("/switchyard/v1/{cluster}/probe");
    client.put(inside.as_str(), "x", None).await.unwrap();
    for outside in [
        "/switchyard/v1/another-cluster/workers/w".to_owned(),
        "/elsewhere".to_owned(),
    ] {
        let err = client.put(outside.as_str(), "x", None).await.unwrap_err();
        assert!(
            err.to_string().contains("permission denied"),
            "{outside}: {err}"
        );
    }
    assert!(client.user_list().await.is_err(), "the member is not root");

    // A worker logged in as the member user registers and is found.
    let _worker = Launch::worker(&endpoint, &cluster)
        .arg("--speedup", "20")
        .args([
            "--etcd-username",
            "switchyard",
            "--etcd-password-file",
            &path(&password_file),
            "--etcd-ca",
            &path(&member.ca),
            "--etcd-cert",
            &path(&member.cert),
            "--etcd-key",
            &path(&member.key),
        ])
        .start()
        .await;
    let registry = EtcdRegistry::connect_with(
        std::slice::from_ref(&endpoint),
        &cluster,
        &EtcdAuth {
            user: Some(("switchyard".into(), "second-password-0123".into())),
            ca_pem: Some(read(&member.ca)),
            identity_pem: Some((read(&member.cert), read(&member.key))),
            ..EtcdAuth::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(registry.list_workers().await.unwrap().len(), 1);

    // Bad settings: exit 64 with a sentence.
    let mut no_password = args.clone();
    no_password[5] = path(&dir.path().join("missing"));
    let (code, _, stderr) = etcd_auth(&no_password).await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("password file"), "{stderr}");
    let mut root_user = args.clone();
    root_user.extend(["--user".to_owned(), "root".to_owned()]);
    let (code, _, stderr) = etcd_auth(&root_user).await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("other than root"), "{stderr}");
}

/// etcd client TLS presenting `files` (the test CA, a client certificate and its key).
fn etcd_tls(files: &switchyard_testkit::certs::MemberFiles) -> etcd_client::TlsOptions {
    let read = |p: &std::path::Path| std::fs::read(p).unwrap();
    etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(read(&files.ca)))
        .identity(etcd_client::Identity::from_pem(
            read(&files.cert),
            read(&files.key),
        ))
}

/// Turns authentication on in the etcd at `endpoint` (TLS, client certificate `client`): a root
/// user with [`PASSWORD`], then auth enable.
async fn enable_auth(endpoint: &str, client: &switchyard_testkit::certs::MemberFiles) {
    let options = etcd_client::ConnectOptions::new().with_tls(etcd_tls(client));
    let mut admin = etcd_client::Client::connect([endpoint], Some(options))
        .await
        .unwrap();
    admin.user_add("root", PASSWORD, None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();
}

/// Everything on at once, as the chart deploys it: etcd over TLS with client certificates and
/// users, mTLS between the gateway and the worker (identities in their certificates), HTTPS on
/// the gateway with API keys. A client with a key is served; without one it gets a 401; plain
/// HTTP to the gateway gets no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_tls_mtls_etcd_users_and_api_keys_serves_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("secured cluster test ca").unwrap();
    let server = ca.issue(dir.path(), "etcd-server", None).unwrap();
    let etcd_client_files = ca.issue(dir.path(), "etcd-client", None).unwrap();
    let etcd = EtcdServer::start_tls(EtcdTls {
        cert: server.cert.clone(),
        key: server.key.clone(),
        ca: server.ca.clone(),
    })
    .expect("etcd with tls");
    let endpoint = etcd.endpoint();
    enable_auth(&endpoint, &etcd_client_files).await;

    let cluster = format!("secured-{}", std::process::id());
    let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let password_file = dir.path().join("etcd-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let etcd_flags = vec![
        "--etcd-username".to_owned(),
        "root".to_owned(),
        "--etcd-password-file".to_owned(),
        path(&password_file),
        "--etcd-ca".to_owned(),
        path(&etcd_client_files.ca),
        "--etcd-cert".to_owned(),
        path(&etcd_client_files.cert),
        "--etcd-key".to_owned(),
        path(&etcd_client_files.key),
    ];
    let member_flags = |role: &str| {
        let files = ca
            .issue(
                dir.path(),
                &format!("member-{role}"),
                Some(&TestCa::identity_uri(&cluster, role)),
            )
            .unwrap();
        vec![
            "--tls-cert".to_owned(),
            path(&files.cert),
            "--tls-key".to_owned(),
            path(&files.key),
            "--tls-ca".to_owned(),
            path(&files.ca),
        ]
    };
    let https = ca.issue(dir.path(), "gateway-https", None).unwrap();
    const KEY: &str = "sk-secured-0123456789abcdef";
    let keys = dir.path().join("api-keys");
    std::fs::write(
        &keys,
        format!(
            "{} team-a\n",
            switchyard_security::secret::sha256_hex(KEY.as_bytes())
        ),
    )
    .unwrap();

    let _worker = Launch::worker(&endpoint, &cluster)
        .arg("--speedup", "20")
        .args(&etcd_flags)
        .args(member_flags("worker"))
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster)
        .args(&etcd_flags)
        .args(member_flags("gateway"))
        .arg("--api-keys-file", &path(&keys))
        .arg("--http-tls-cert", &path(&https.cert))
        .arg("--http-tls-key", &path(&https.key))
        .start()
        .await;

    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(ca.cert_pem.as_bytes()).unwrap())
        .build()
        .unwrap();
    let port = gateway.address.rsplit(':').next().unwrap().to_owned();
    let base = format!("https://localhost:{port}");
    let body = json!({"model": "sim-8b", "prompt": tokens(2, 64), "max_tokens": 2});
    let send = |key: Option<&'static str>| {
        let mut request = client.post(format!("{base}/v1/completions")).json(&body);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        request.send()
    };
    // The worker joins through the TLS etcd and is called over mTLS: a keyed request is served.
    let served = support::eventually(std::time::Duration::from_secs(20), || async {
        send(Some(KEY))
            .await
            .is_ok_and(|r| r.status() == reqwest::StatusCode::OK)
    })
    .await;
    assert!(served, "a client with a key was served end to end");
    let answer: serde_json::Value = send(Some(KEY)).await.unwrap().json().await.unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 2, "{answer}");
    assert_eq!(send(None).await.unwrap().status(), 401);
    let plain = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/v1/completions"))
        .bearer_auth(KEY)
        .json(&body)
        .send()
        .await;
    assert!(
        plain.is_err_and(|e| !e.is_status()),
        "plain HTTP got an HTTP answer from the HTTPS port"
    );
}
