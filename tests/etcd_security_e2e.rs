//! etcd with TLS, client certificates and users (issue 22), end to end: a real etcd whose client
//! port speaks TLS only and wants a certificate of the test CA, with authentication enabled;
//! a worker and a gateway given the CA, a client certificate and a user serve a request through
//! it, while a registry client without the user, with a wrong password, without a client
//! certificate, or in plain text is refused.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

mod support;

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
    {
        let tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(read(&client.ca)))
            .identity(etcd_client::Identity::from_pem(
                read(&client.cert),
                read(&client.key),
            ));
        let options = etcd_client::ConnectOptions::new().with_tls(tls);
        let mut admin = etcd_client::Client::connect([endpoint.as_str()], Some(options))
            .await
            .unwrap();
        admin.user_add("root", PASSWORD, None).await.unwrap();
        admin.user_grant_role("root", "root").await.unwrap();
        admin.auth_enable().await.unwrap();
    }
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
