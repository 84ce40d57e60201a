//! Who is calling, and may they: the server's [`Authorizer`] and the client's [`Credential`].
//!
//! A caller is identified by its verified mTLS certificate when it presents one, else by its
//! cluster-secret credential (metadata [`CREDENTIAL_HEADER`]). A refusal says only what the
//! caller needs to know (`UNAUTHENTICATED`: prove who you are; `PERMISSION_DENIED`: your role
//! may not make this call); why a credential failed stays in the server's log.

use std::time::SystemTime;

use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::{Request, Status};

use crate::ahead::ReadAhead;
use crate::identity::{Identity, PeerRole};
use crate::secret::ClusterSecret;

/// The gRPC metadata entry a cluster-secret credential travels in.
pub const CREDENTIAL_HEADER: &str = "x-switchyard-credential";

/// A channel whose every call carries the caller's credential (and whose request bodies are
/// read ahead, [`crate::ahead`]).
pub type AuthChannel = InterceptedService<ReadAhead<Channel>, Credential>;

/// The client side: adds a fresh credential to each call when the cluster has a secret (with
/// mTLS the certificate already says who calls).
#[derive(Debug, Clone)]
pub struct Credential {
    identity: Identity,
    secret: Option<ClusterSecret>,
}

impl Credential {
    pub fn new(identity: Identity, secret: Option<ClusterSecret>) -> Self {
        Self { identity, secret }
    }

    /// A caller with no proof (an open cluster, or a test of what an outsider gets).
    pub fn none(identity: Identity) -> Self {
        Self::new(identity, None)
    }

    pub fn identity(&self) -> &Identity {
        &self.identity
    }
}

impl Interceptor for Credential {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(secret) = &self.secret {
            let value = secret.credential(&self.identity, SystemTime::now());
            let value = value
                .parse()
                .map_err(|_| Status::internal("cluster credential is not valid metadata"))?;
            request.metadata_mut().insert(CREDENTIAL_HEADER, value);
        }
        Ok(request)
    }
}

/// The server side: which members of which cluster a worker serves.
#[derive(Debug, Clone)]
pub struct Authorizer {
    cluster: String,
    secret: Option<ClusterSecret>,
    mtls: bool,
}

impl Authorizer {
    /// `mtls`: the server verifies client certificates against the cluster CA.
    pub fn new(cluster: impl Into<String>, secret: Option<ClusterSecret>, mtls: bool) -> Self {
        Self {
            cluster: cluster.into(),
            secret,
            mtls,
        }
    }

    /// Everything allowed: no secret and no mTLS (the zero-configuration local mode).
    pub fn open(cluster: impl Into<String>) -> Self {
        Self::new(cluster, None, false)
    }

    pub fn is_open(&self) -> bool {
        self.secret.is_none() && !self.mtls
    }

    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// The caller's role in this cluster; `None` in an open cluster, where nobody is asked.
    pub fn caller<T>(&self, request: &Request<T>) -> Result<Option<PeerRole>, Status> {
        if self.is_open() {
            return Ok(None);
        }
        let certs = request
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(TlsConnectInfo::peer_certs);
        if let Some(certs) = certs
            && let Some(leaf) = certs.first()
        {
            // The TLS layer verified the chain against the cluster CA already.
            let Some(identity) = Identity::from_certificate(leaf) else {
                tracing::warn!(
                    "refused a call: the client certificate carries no switchyard identity"
                );
                return Err(Status::unauthenticated(
                    "the client certificate names no switchyard identity",
                ));
            };
            if identity.cluster != self.cluster {
                tracing::warn!(caller = %identity, "refused a call from another cluster");
                return Err(Status::permission_denied(
                    "the caller belongs to another cluster",
                ));
            }
            return Ok(Some(identity.role));
        }
        let Some(secret) = &self.secret else {
            return Err(Status::unauthenticated(
                "this worker serves members of its cluster only: present a cluster certificate",
            ));
        };
        let Some(credential) = request
            .metadata()
            .get(CREDENTIAL_HEADER)
            .and_then(|v| v.to_str().ok())
        else {
            return Err(Status::unauthenticated(
                "this worker serves members of its cluster only: the call carries no cluster credential",
            ));
        };
        match secret.check_credential(&self.cluster, credential, SystemTime::now()) {
            Ok(role) => Ok(Some(role)),
            Err(why) => {
                tracing::warn!(?why, "refused a call with an invalid cluster credential");
                Err(Status::unauthenticated(
                    "the cluster credential is not valid",
                ))
            }
        }
    }

    /// Lets the call `call` through when its caller's role is one of `allowed`.
    pub fn require<T>(
        &self,
        request: &Request<T>,
        call: &str,
        allowed: &[PeerRole],
    ) -> Result<(), Status> {
        match self.caller(request)? {
            None => Ok(()),
            Some(role) if allowed.contains(&role) => Ok(()),
            Some(role) => {
                tracing::warn!(%role, call, "refused a call the caller's role may not make");
                Err(Status::permission_denied(format!(
                    "a {role} may not call {call}"
                )))
            }
        }
    }

    /// Lets any member of this cluster through.
    pub fn require_member<T>(&self, request: &Request<T>) -> Result<(), Status> {
        self.caller(request).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> ClusterSecret {
        ClusterSecret::from_bytes(b"a-test-secret-of-enough-bytes").unwrap()
    }

    fn request_from(credential: &Credential) -> Request<()> {
        let mut credential = credential.clone();
        credential.call(Request::new(())).unwrap()
    }

    #[test]
    fn an_open_cluster_lets_everyone_through() {
        let auth = Authorizer::open("c1");
        assert!(auth.is_open());
        auth.require(&Request::new(()), "Control", &[PeerRole::Planner])
            .unwrap();
    }

    #[test]
    fn roles_are_checked_against_the_call() {
        let auth = Authorizer::new("c1", Some(secret()), false);
        let planner = Credential::new(Identity::new("c1", PeerRole::Planner), Some(secret()));
        let gateway = Credential::new(Identity::new("c1", PeerRole::Gateway), Some(secret()));
        auth.require(&request_from(&planner), "Control", &[PeerRole::Planner])
            .unwrap();
        let denied = auth
            .require(&request_from(&gateway), "Control", &[PeerRole::Planner])
            .unwrap_err();
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        assert!(denied.message().contains("gateway may not call Control"));
    }

    #[test]
    fn outsiders_are_unauthenticated() {
        let auth = Authorizer::new("c1", Some(secret()), false);
        let none = Credential::none(Identity::new("c1", PeerRole::Planner));
        let status = auth.require_member(&request_from(&none)).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        let wrong = Credential::new(
            Identity::new("c1", PeerRole::Planner),
            Some(ClusterSecret::from_bytes(b"some-other-secret-entirely").unwrap()),
        );
        let status = auth.require_member(&request_from(&wrong)).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        assert_eq!(status.message(), "the cluster credential is not valid");
        let other_cluster = Credential::new(Identity::new("c2", PeerRole::Planner), Some(secret()));
        let status = auth
            .require_member(&request_from(&other_cluster))
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
    }
}
