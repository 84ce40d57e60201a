//! [`Dialer`]: how every role opens a gRPC channel to a worker, plain or over mTLS, with its
//! credential on every call.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tonic::transport::Endpoint;

use crate::ahead::ReadAhead;
use crate::authorize::{AuthChannel, Credential};
use crate::error::SecurityError;
use crate::identity::Identity;
use crate::tls::Reloading;

/// Longest a TCP connect plus TLS handshake to a worker may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens channels to workers as one member of a cluster.
#[derive(Debug, Clone)]
pub struct Dialer {
    credential: Credential,
    tls: Option<Arc<Reloading<ClientConfig>>>,
}

impl Dialer {
    pub fn new(credential: Credential, tls: Option<Arc<Reloading<ClientConfig>>>) -> Self {
        Self { credential, tls }
    }

    /// A dialer of an open cluster: plain channels, no credential.
    pub fn open(identity: Identity) -> Self {
        Self::new(Credential::none(identity), None)
    }

    pub fn identity(&self) -> &Identity {
        self.credential.identity()
    }

    pub fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The endpoint of a worker address (`host:port`); tune it, then [`lazy`](Self::lazy) or
    /// [`connect`](Self::connect).
    pub fn endpoint(&self, address: &str) -> Result<Endpoint, SecurityError> {
        if address.contains("://") || address.contains('/') {
            return Err(SecurityError::Address {
                address: address.to_owned(),
                message: "expected host:port".into(),
            });
        }
        Endpoint::from_shared(format!("http://{address}")).map_err(|e| SecurityError::Address {
            address: address.to_owned(),
            message: e.to_string(),
        })
    }

    /// A channel that connects on first use.
    pub fn lazy(&self, endpoint: Endpoint) -> AuthChannel {
        let channel = match &self.tls {
            Some(tls) => endpoint.connect_with_connector_lazy(TlsDial {
                config: Arc::clone(tls),
            }),
            None => endpoint.connect_lazy(),
        };
        AuthChannel::new(ReadAhead::new(channel), self.credential.clone())
    }

    /// A channel connected now.
    pub async fn connect(&self, endpoint: Endpoint) -> Result<AuthChannel, SecurityError> {
        let address = endpoint.uri().to_string();
        let connected = match &self.tls {
            Some(tls) => {
                endpoint
                    .connect_with_connector(TlsDial {
                        config: Arc::clone(tls),
                    })
                    .await
            }
            None => endpoint.connect().await,
        };
        let channel = connected.map_err(|source| SecurityError::Connect { address, source })?;
        Ok(AuthChannel::new(
            ReadAhead::new(channel),
            self.credential.clone(),
        ))
    }
}

/// The connector of TLS channels: TCP (no Nagle), then the handshake with the current client
/// configuration (so a rotated certificate is used from the next connection on).
#[derive(Debug, Clone)]
struct TlsDial {
    config: Arc<Reloading<ClientConfig>>,
}

type DialFuture =
    Pin<Box<dyn Future<Output = Result<TokioIo<TlsStream<TcpStream>>, std::io::Error>> + Send>>;

impl tower::Service<Uri> for TlsDial {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = DialFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let config = self.config.get();
        Box::pin(async move {
            let invalid =
                |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, m.to_owned());
            let host = uri
                .host()
                .ok_or_else(|| invalid("worker address has no host"))?;
            let port = uri
                .port_u16()
                .ok_or_else(|| invalid("worker address has no port"))?;
            // Workers are checked by identity, not name; the name only has to be well formed.
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let name = ServerName::try_from(host.to_owned())
                .or_else(|_| ServerName::try_from("switchyard-worker".to_owned()))
                .map_err(|_| invalid("no server name"))?;
            let dial = async {
                let tcp = TcpStream::connect((host, port)).await?;
                tcp.set_nodelay(true)?;
                TlsConnector::from(config).connect(name, tcp).await
            };
            let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, dial)
                .await
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "tls handshake timed out")
                })??;
            Ok(TokioIo::new(tls))
        })
    }
}
