//! Certificates and keys from files, re-read when they change ([`Reloading`], which the
//! gateway's API key list uses too), and the rustls configurations built from them.
//!
//! cert-manager (or any rotation) replaces the files of a mounted Secret in place; every new
//! connection asks [`Reloading::get`] for the configuration, which looks at the files' times and
//! sizes at most once per [`RELOAD_CHECK`] and rebuilds when they changed. A rebuild that fails
//! (a half-written key) keeps the last good configuration and says so in the log, so a rotation
//! can never take a running process off the network.
//!
//! Members verify each other by identity, not host name: a worker's address is whatever its pod
//! got, so a client checks that the server's certificate chains to the cluster CA and carries
//! the identity URI of a worker of its cluster ([`IdentityVerifier`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

use crate::error::SecurityError;
use crate::identity::{Identity, PeerRole};

/// How often the files are looked at for a change.
pub const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// A certificate chain, its key and (for mTLS) the CA that signs the cluster's members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: Option<PathBuf>,
}

impl TlsFiles {
    fn paths(&self) -> Vec<PathBuf> {
        let mut paths = vec![self.cert.clone(), self.key.clone()];
        paths.extend(self.ca.clone());
        paths
    }

    fn chain(&self) -> Result<Vec<CertificateDer<'static>>, SecurityError> {
        read_certs(&self.cert, "certificate file")
    }

    fn private_key(&self) -> Result<PrivateKeyDer<'static>, SecurityError> {
        PrivateKeyDer::from_pem_file(&self.key).map_err(|e| pem_error(&self.key, "key file", e))
    }

    fn roots(&self) -> Result<Arc<RootCertStore>, SecurityError> {
        let Some(ca) = &self.ca else {
            return Err(SecurityError::Setting(
                "mutual TLS needs the cluster CA (tls_ca)".into(),
            ));
        };
        ca_roots(ca)
    }
}

fn ca_roots(ca: &Path) -> Result<Arc<RootCertStore>, SecurityError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(ca, "CA file")? {
        roots.add(cert).map_err(|e| SecurityError::Invalid {
            what: "CA file",
            path: ca.to_owned(),
            message: e.to_string(),
        })?;
    }
    Ok(Arc::new(roots))
}

fn read_certs(
    path: &Path,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, SecurityError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_error(path, what, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, what, e))?;
    if certs.is_empty() {
        return Err(SecurityError::Invalid {
            what,
            path: path.to_owned(),
            message: "it holds no PEM certificate".into(),
        });
    }
    Ok(certs)
}

fn pem_error(path: &Path, what: &'static str, e: rustls_pki_types::pem::Error) -> SecurityError {
    match e {
        rustls_pki_types::pem::Error::Io(source) => SecurityError::Read {
            what,
            path: path.to_owned(),
            source,
        },
        other => SecurityError::Invalid {
            what,
            path: path.to_owned(),
            message: other.to_string(),
        },
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The server side of the cluster's gRPC: the member's certificate; a client certificate is
/// verified against the CA when one is presented (calls are then authorised per method, so a
/// health probe without one still gets an answer).
pub fn grpc_server_config(files: &TlsFiles) -> Result<ServerConfig, SecurityError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(files.roots()?, provider())
        .allow_unauthenticated()
        .build()?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(files.chain()?, files.private_key()?)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// A public HTTPS listener: the certificate only, HTTP/2 and HTTP/1.1 by ALPN.
pub fn http_server_config(files: &TlsFiles) -> Result<ServerConfig, SecurityError> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(files.chain()?, files.private_key()?)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// A client of an HTTPS listener (the planner reading a gateway's `/metrics`): trusts only
/// certificates `ca` signs, checked against the host name as any HTTPS client does.
pub fn https_client_config(ca: &Path) -> Result<ClientConfig, SecurityError> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(ca_roots(ca)?)
        .with_no_client_auth())
}

/// A member dialing a worker: presents its own certificate and accepts only a server whose
/// certificate chains to the CA and names a worker of `cluster`.
pub fn grpc_client_config(files: &TlsFiles, cluster: &str) -> Result<ClientConfig, SecurityError> {
    let inner = WebPkiServerVerifier::builder_with_provider(files.roots()?, provider())
        .build()
        .map_err(|e| SecurityError::Setting(format!("server certificate verifier: {e}")))?;
    let verifier = IdentityVerifier {
        inner,
        expect: Identity::new(cluster, PeerRole::Worker),
    };
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_auth_cert(files.chain()?, files.private_key()?)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Verifies the chain (validity, signatures, usage) as webpki does, then the identity URI in
/// place of the host name.
#[derive(Debug)]
pub struct IdentityVerifier {
    inner: Arc<WebPkiServerVerifier>,
    expect: Identity,
}

impl ServerCertVerifier for IdentityVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // webpki checks the chain before the name, so a name mismatch means the chain is good.
        match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Ok(_)
            | Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => {}
            Err(other) => return Err(other),
        }
        if Identity::from_certificate(end_entity).as_ref() == Some(&self.expect) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

type Build<T> = Box<dyn Fn() -> Result<T, SecurityError> + Send + Sync>;

/// A configuration built from files and rebuilt when they change.
pub struct Reloading<T> {
    what: &'static str,
    paths: Vec<PathBuf>,
    build: Build<T>,
    state: Mutex<ReloadState<T>>,
}

struct ReloadState<T> {
    stamp: Vec<Option<(SystemTime, u64)>>,
    checked: Instant,
    current: Arc<T>,
}

impl<T> std::fmt::Debug for Reloading<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading")
            .field("what", &self.what)
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

fn stamp(paths: &[PathBuf]) -> Vec<Option<(SystemTime, u64)>> {
    paths
        .iter()
        .map(|p| {
            let meta = std::fs::metadata(p).ok()?;
            Some((meta.modified().ok()?, meta.len()))
        })
        .collect()
}

impl<T> Reloading<T> {
    /// Builds once (an error here is a configuration error at start) and keeps the files'
    /// stamps to notice changes.
    pub fn new(
        what: &'static str,
        files: &TlsFiles,
        build: impl Fn() -> Result<T, SecurityError> + Send + Sync + 'static,
    ) -> Result<Self, SecurityError> {
        Self::watching(what, files.paths(), build)
    }

    /// [`new`](Self::new) over any files (an API key list, a token file).
    pub fn watching(
        what: &'static str,
        paths: Vec<PathBuf>,
        build: impl Fn() -> Result<T, SecurityError> + Send + Sync + 'static,
    ) -> Result<Self, SecurityError> {
        let stamp = stamp(&paths);
        let current = Arc::new(build()?);
        Ok(Self {
            what,
            paths,
            build: Box::new(build),
            state: Mutex::new(ReloadState {
                stamp,
                checked: Instant::now(),
                current,
            }),
        })
    }

    /// The current configuration, rebuilt first if the files changed.
    pub fn get(&self) -> Arc<T> {
        let mut state = self.state.lock();
        if state.checked.elapsed() >= RELOAD_CHECK {
            state.checked = Instant::now();
            let now = stamp(&self.paths);
            if now != state.stamp {
                match (self.build)() {
                    Ok(config) => {
                        tracing::info!(what = self.what, "files changed on disk; reloaded");
                        state.current = Arc::new(config);
                        state.stamp = now;
                    }
                    Err(err) => {
                        // Keep the stamp: a half-written rotation is retried next time.
                        tracing::warn!(what = self.what, error = %err, "files changed on disk but cannot be loaded; keeping the previous ones");
                    }
                }
            }
        }
        Arc::clone(&state.current)
    }
}

#[cfg(test)]
pub(crate) mod tests;
