//! Real handshakes over loopback between configurations built from test certificates.

use std::sync::Arc;

use switchyard_testkit::certs::{MemberFiles, TestCa};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::*;

fn files(member: &MemberFiles) -> TlsFiles {
    TlsFiles {
        cert: member.cert.clone(),
        key: member.key.clone(),
        ca: Some(member.ca.clone()),
    }
}

fn member(ca: &TestCa, dir: &Path, name: &str, cluster: &str, role: &str) -> TlsFiles {
    files(
        &ca.issue(dir, name, Some(&TestCa::identity_uri(cluster, role)))
            .unwrap(),
    )
}

/// Connects a client with `client` to a server with `server`; the server's view of the
/// client's identity, or the client's handshake error.
async fn handshake(server: ServerConfig, client: ClientConfig) -> Result<Option<Identity>, String> {
    crate::install_crypto_provider();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(server));
    let serve = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let tls = acceptor.accept(tcp).await.ok()?;
        let certs = tls.get_ref().1.peer_certificates()?.to_vec();
        certs.first().and_then(Identity::from_certificate)
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let connected = TlsConnector::from(Arc::new(client))
        .connect(name, tcp)
        .await;
    match connected {
        Ok(mut tls) => {
            // TLS 1.3 finishes the client's side first; a byte each way settles the server's.
            use tokio::io::AsyncWriteExt;
            tls.write_all(b"x").await.map_err(|e| e.to_string())?;
            Ok(serve.await.unwrap())
        }
        Err(e) => {
            serve.abort();
            Err(e.to_string())
        }
    }
}

#[tokio::test]
async fn members_see_each_others_identity() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("cluster ca").unwrap();
    let worker = member(&ca, dir.path(), "worker", "c1", "worker");
    let gateway = member(&ca, dir.path(), "gateway", "c1", "gateway");
    let seen = handshake(
        grpc_server_config(&worker).unwrap(),
        grpc_client_config(&gateway, "c1").unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(seen, Some(Identity::new("c1", PeerRole::Gateway)));
}

#[tokio::test]
async fn a_client_refuses_a_server_that_is_not_a_worker_of_its_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("cluster ca").unwrap();
    let gateway = member(&ca, dir.path(), "gateway", "c1", "gateway");
    for (name, cluster, role) in [("g2", "c1", "gateway"), ("w2", "c2", "worker")] {
        let server = member(&ca, dir.path(), name, cluster, role);
        let err = handshake(
            grpc_server_config(&server).unwrap(),
            grpc_client_config(&gateway, "c1").unwrap(),
        )
        .await
        .unwrap_err();
        assert!(err.contains("invalid peer certificate"), "{err}");
    }
    // A worker certificate from another CA.
    let other_dir = tempfile::tempdir().unwrap();
    let other = TestCa::new("someone else").unwrap();
    let foreign = member(&other, other_dir.path(), "worker", "c1", "worker");
    let err = handshake(
        grpc_server_config(&foreign).unwrap(),
        grpc_client_config(&gateway, "c1").unwrap(),
    )
    .await
    .unwrap_err();
    assert!(err.contains("UnknownIssuer"), "{err}");
}

#[tokio::test]
async fn a_server_refuses_a_client_certificate_of_another_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("cluster ca").unwrap();
    let worker = member(&ca, dir.path(), "worker", "c1", "worker");
    let other_dir = tempfile::tempdir().unwrap();
    let other = TestCa::new("someone else").unwrap();
    let mut intruder = member(&other, other_dir.path(), "gateway", "c1", "gateway");
    // The intruder trusts the real CA (to accept the worker) but its own cert is foreign.
    intruder.ca = worker.ca.clone();
    let seen = handshake(
        grpc_server_config(&worker).unwrap(),
        grpc_client_config(&intruder, "c1").unwrap(),
    )
    .await;
    assert!(!matches!(seen, Ok(Some(_))), "{seen:?}");
}

#[tokio::test]
async fn rotated_files_are_picked_up_and_broken_ones_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("cluster ca").unwrap();
    let files = member(&ca, dir.path(), "worker", "c1", "worker");
    let for_build = files.clone();
    let reloading = Reloading::new("test", &files, move || for_build.chain()).unwrap();
    let first = reloading.get();
    // A half-written rotation keeps the old chain.
    std::fs::write(&files.cert, "-----BEGIN CERTIFICATE-----\nnot base64\n").unwrap();
    tokio::time::sleep(RELOAD_CHECK + Duration::from_millis(50)).await;
    assert_eq!(reloading.get(), first);
    // The finished rotation is used.
    let rotated = ca
        .issue(
            dir.path(),
            "worker",
            Some(&TestCa::identity_uri("c1", "worker")),
        )
        .unwrap();
    assert_eq!(rotated.cert, files.cert);
    tokio::time::sleep(RELOAD_CHECK + Duration::from_millis(50)).await;
    let second = reloading.get();
    assert_ne!(second, first);
    assert_eq!(*second, files.chain().unwrap());
}
