//! Who may talk to whom in a Switchyard cluster (issue 22).
//!
//! Every process of a cluster has a [`PeerRole`] (gateway, planner or worker) in a named
//! cluster: its [`Identity`]. A worker serves its gRPC calls only to the identities allowed to
//! make them (the planner controls, gateways generate and prefill, workers of the same cluster
//! pull KV), and a caller proves its identity in one of two ways:
//!
//! - **mTLS**: its certificate, signed by the cluster's CA, carries the identity as a URI
//!   subject alternative name (`spiffe://switchyard/<cluster>/<role>`, see [`identity`]).
//! - **the cluster secret** (when TLS is off): each call carries an HMAC-SHA256 of the identity
//!   and the time under the secret every member reads from a file ([`secret`]).
//!
//! With neither configured the cluster is *open*: the zero-configuration local mode of
//! `switchyard up` on loopback, where everything is allowed.
//!
//! Modules:
//! - [`identity`]: roles, identities, the certificate URI that names them.
//! - [`secret`]: the cluster secret, its per-call credentials and the HMAC proofs the registry
//!   entries carry.
//! - [`tls`]: certificates and keys read from files and re-read when they change (as
//!   cert-manager rotates them), rustls server and client configurations from them, and the
//!   verifier that checks a server by its identity rather than its host name.
//! - [`authorize`]: the server side, [`Authorizer`] (who is calling, and may they); the client
//!   side, [`Credential`] (a tonic interceptor that adds the caller's proof to every call).
//! - [`dial`]: [`Dialer`], the one way every role opens a gRPC channel to a worker (plain or TLS,
//!   with its credential).
//! - [`incoming`]: TLS handshakes off the accept loop, with a timeout, for the worker's gRPC
//!   server and the HTTP listeners.
//! - [`server`]: the one HTTP server of every listener (the gateway's OpenAI API, the endpoint
//!   picker's, the worker's metrics, the planner's admin API): a connection cap, header, body
//!   and idle timeouts, HTTP/2 limits, TLS handshakes in the connection's task, phased shutdown.
//! - [`listener`]: HTTPS for the HTTP listeners from reloaded certificate files, and the limits
//!   of the side listeners (metrics, planner admin).
//! - [`config`]: [`SecurityConfig`], the `[security]` table every role's configuration carries,
//!   and its flags.

// Tests may unwrap: a failure there is the test failing.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod ahead;
pub mod authorize;
pub mod config;
pub mod dial;
pub mod error;
pub mod identity;
pub mod incoming;
pub mod listener;
pub mod secret;
pub mod server;
pub mod tls;

pub use authorize::{AuthChannel, Authorizer, Credential};
pub use config::{SecurityArgs, SecurityConfig};
pub use dial::Dialer;
pub use error::SecurityError;
pub use identity::{Identity, PeerRole};
pub use secret::ClusterSecret;
pub use tls::TlsFiles;

/// Installs ring as rustls's process-wide crypto provider, once; rustls needs one when a
/// configuration is built without naming its provider (as tonic's and etcd's clients do).
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
