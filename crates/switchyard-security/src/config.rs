//! The `[security]` table every role's configuration carries, its flags and environment
//! variables, and what it builds: the role's [`Authorizer`], [`Dialer`] and server TLS.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::{ClientConfig, ServerConfig};
use serde::Deserialize;
use switchyard_registry::EtcdAuth;

use crate::authorize::{Authorizer, Credential};
use crate::dial::Dialer;
use crate::error::SecurityError;
use crate::identity::{Identity, PeerRole};
use crate::secret::ClusterSecret;
use crate::tls::{Reloading, TlsFiles, grpc_client_config, grpc_server_config};

/// How this member proves who it is and checks who calls it. Empty: an open cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SecurityConfig {
    /// File holding the cluster secret (every member of the cluster reads the same one).
    pub cluster_secret_file: Option<PathBuf>,
    /// This member's certificate chain (PEM), with its identity URI; turns on mTLS.
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    pub tls_key: Option<PathBuf>,
    /// The cluster CA (PEM) members' certificates are signed by.
    pub tls_ca: Option<PathBuf>,
    /// etcd user (etcd's own authentication); needs `etcd_password_file`.
    pub etcd_username: Option<String>,
    /// File holding the etcd user's password.
    pub etcd_password_file: Option<PathBuf>,
    /// CA (PEM) of etcd's server certificate: talk to etcd over TLS.
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate chain (PEM) for etcd's `--client-cert-auth`.
    pub etcd_cert: Option<PathBuf>,
    /// The etcd client certificate's key (PEM).
    pub etcd_key: Option<PathBuf>,
}

/// What a role runs with, built once at start.
#[derive(Debug, Clone)]
pub struct Security {
    /// Checks callers (the worker's gRPC server).
    pub authorizer: Authorizer,
    /// Opens channels to workers as this member.
    pub dialer: Dialer,
    /// The gRPC server's TLS, when mTLS is on.
    pub server_tls: Option<Arc<Reloading<ServerConfig>>>,
    pub secret: Option<ClusterSecret>,
    /// How to reach etcd.
    pub etcd: EtcdAuth,
}

impl SecurityConfig {
    /// The mTLS files, when all three are given.
    pub fn tls_files(&self) -> Option<TlsFiles> {
        Some(TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            ca: Some(self.tls_ca.clone()?),
        })
    }

    /// No secret and no certificates: every worker call is allowed.
    pub fn is_open(&self) -> bool {
        self.cluster_secret_file.is_none() && self.tls_cert.is_none()
    }

    /// Checks the settings fit together (files are read by [`build`](Self::build)).
    pub fn validate(&self) -> Result<(), SecurityError> {
        let given = [&self.tls_cert, &self.tls_key, &self.tls_ca]
            .iter()
            .filter(|p| p.is_some())
            .count();
        if given != 0 && given != 3 {
            return Err(SecurityError::Setting(
                "mutual TLS needs tls_cert, tls_key and tls_ca together".into(),
            ));
        }
        if self.etcd_username.is_some() != self.etcd_password_file.is_some() {
            return Err(SecurityError::Setting(
                "etcd authentication needs etcd_username and etcd_password_file together".into(),
            ));
        }
        if self.etcd_cert.is_some() != self.etcd_key.is_some() {
            return Err(SecurityError::Setting(
                "an etcd client certificate needs etcd_cert and etcd_key together".into(),
            ));
        }
        if self.etcd_cert.is_some() && self.etcd_ca.is_none() {
            return Err(SecurityError::Setting(
                "an etcd client certificate needs etcd_ca (TLS toward etcd) too".into(),
            ));
        }
        Ok(())
    }

    /// Reads what reaching etcd takes: the password, the CA, the client certificate, and the
    /// cluster secret that signs and checks worker entries.
    pub fn etcd_auth(&self) -> Result<EtcdAuth, SecurityError> {
        let read = |what: &'static str, path: &PathBuf| {
            std::fs::read(path).map_err(|source| SecurityError::Read {
                what,
                path: path.clone(),
                source,
            })
        };
        let user = match (&self.etcd_username, &self.etcd_password_file) {
            (Some(name), Some(file)) => {
                let password = read("etcd password file", file)?;
                let password = String::from_utf8(password.trim_ascii().to_vec()).map_err(|_| {
                    SecurityError::Invalid {
                        what: "etcd password file",
                        path: file.clone(),
                        message: "it is not UTF-8 text".into(),
                    }
                })?;
                Some((name.clone(), password))
            }
            _ => None,
        };
        let ca_pem = self
            .etcd_ca
            .as_ref()
            .map(|p| read("etcd CA file", p))
            .transpose()?;
        let identity_pem = match (&self.etcd_cert, &self.etcd_key) {
            (Some(cert), Some(key)) => Some((
                read("etcd certificate file", cert)?,
                read("etcd key file", key)?,
            )),
            _ => None,
        };
        // Entries are signed and checked with the cluster secret when there is one.
        let proof = self
            .cluster_secret_file
            .as_deref()
            .map(ClusterSecret::from_file)
            .transpose()?
            .map(|secret| Arc::new(secret) as Arc<dyn switchyard_registry::EntryProof>);
        Ok(EtcdAuth {
            user,
            ca_pem,
            identity_pem,
            proof,
        })
    }

    /// Reads the secret and the certificates and builds what `role` of `cluster` runs with.
    pub fn build(&self, cluster: &str, role: PeerRole) -> Result<Security, SecurityError> {
        self.validate()?;
        crate::install_crypto_provider();
        let secret = self
            .cluster_secret_file
            .as_deref()
            .map(ClusterSecret::from_file)
            .transpose()?;
        let identity = Identity::new(cluster, role);
        let (client_tls, server_tls) = match self.tls_files() {
            Some(files) => {
                let for_client = files.clone();
                let cluster_name = cluster.to_owned();
                let client: Reloading<ClientConfig> =
                    Reloading::new("client certificate", &files, move || {
                        grpc_client_config(&for_client, &cluster_name)
                    })?;
                let for_server = files.clone();
                let server: Reloading<ServerConfig> =
                    Reloading::new("server certificate", &files, move || {
                        grpc_server_config(&for_server)
                    })?;
                check_own_identity(&files, &identity)?;
                (Some(Arc::new(client)), Some(Arc::new(server)))
            }
            None => (None, None),
        };
        Ok(Security {
            etcd: self.etcd_auth()?,
            authorizer: Authorizer::new(cluster, secret.clone(), server_tls.is_some()),
            dialer: Dialer::new(Credential::new(identity, secret.clone()), client_tls),
            server_tls,
            secret,
        })
    }
}

/// A member's own certificate must name it, or every peer would refuse it later with a less
/// helpful error.
fn check_own_identity(files: &TlsFiles, identity: &Identity) -> Result<(), SecurityError> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let leaf = CertificateDer::pem_file_iter(&files.cert)
        .ok()
        .and_then(|mut certs| certs.next())
        .and_then(Result::ok);
    let named = leaf.as_ref().and_then(Identity::from_certificate);
    if named.as_ref() == Some(identity) {
        Ok(())
    } else {
        Err(SecurityError::Invalid {
            what: "certificate file",
            path: files.cert.clone(),
            message: format!(
                "its certificate must carry the URI {} (it names {})",
                identity.uri(),
                named.map_or_else(|| "no switchyard identity".to_owned(), |n| n.uri())
            ),
        })
    }
}

/// Flags and `SWITCHYARD_*` environment variables of the `[security]` table.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SecurityArgs {
    /// File holding the cluster secret that authenticates members when TLS is off.
    #[arg(long, env = "SWITCHYARD_CLUSTER_SECRET_FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// This member's certificate chain (PEM, with its spiffe://switchyard/<cluster>/<role> URI).
    #[arg(long, env = "SWITCHYARD_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "SWITCHYARD_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The cluster CA (PEM).
    #[arg(long, env = "SWITCHYARD_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// etcd user name (etcd's own authentication).
    #[arg(long, env = "SWITCHYARD_ETCD_USERNAME")]
    pub etcd_username: Option<String>,
    /// File holding the etcd user's password.
    #[arg(long, env = "SWITCHYARD_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// CA (PEM) of etcd's server certificate: talk to etcd over TLS.
    #[arg(long, env = "SWITCHYARD_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcd's client-certificate authentication.
    #[arg(long, env = "SWITCHYARD_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    /// The etcd client certificate's key (PEM).
    #[arg(long, env = "SWITCHYARD_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
}

impl SecurityArgs {
    /// Overrides what the file said with what flags and the environment say.
    pub fn apply(&self, config: &mut SecurityConfig) {
        for (flag, target) in [
            (&self.cluster_secret_file, &mut config.cluster_secret_file),
            (&self.tls_cert, &mut config.tls_cert),
            (&self.tls_key, &mut config.tls_key),
            (&self.tls_ca, &mut config.tls_ca),
            (&self.etcd_password_file, &mut config.etcd_password_file),
            (&self.etcd_ca, &mut config.etcd_ca),
            (&self.etcd_cert, &mut config.etcd_cert),
            (&self.etcd_key, &mut config.etcd_key),
        ] {
            if flag.is_some() {
                target.clone_from(flag);
            }
        }
        if self.etcd_username.is_some() {
            config.etcd_username.clone_from(&self.etcd_username);
        }
    }
}
