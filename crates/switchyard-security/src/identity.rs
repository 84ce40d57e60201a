//! Peer roles and identities, and the certificate URI that names them.
//!
//! An identity is written `spiffe://switchyard/<cluster>/<role>` as a URI subject alternative
//! name of the member's certificate (cert-manager: `spec.uris`), so the certificate says what
//! its holder may do and in which cluster, whatever host name or IP the pod has.

use std::fmt;

use rustls_pki_types::CertificateDer;

/// What a member of a cluster is, as far as the calls it may make are concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerRole {
    Gateway,
    Planner,
    Worker,
}

impl PeerRole {
    pub const ALL: [PeerRole; 3] = [PeerRole::Gateway, PeerRole::Planner, PeerRole::Worker];

    pub fn as_str(self) -> &'static str {
        match self {
            PeerRole::Gateway => "gateway",
            PeerRole::Planner => "planner",
            PeerRole::Worker => "worker",
        }
    }

    pub fn parse(text: &str) -> Option<PeerRole> {
        PeerRole::ALL.into_iter().find(|r| r.as_str() == text)
    }
}

impl fmt::Display for PeerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role in a named cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub cluster: String,
    pub role: PeerRole,
}

/// The scheme and authority every identity URI starts with.
const URI_PREFIX: &str = "spiffe://switchyard/";

impl Identity {
    pub fn new(cluster: impl Into<String>, role: PeerRole) -> Self {
        Self {
            cluster: cluster.into(),
            role,
        }
    }

    /// `spiffe://switchyard/<cluster>/<role>`: what a member's certificate carries.
    pub fn uri(&self) -> String {
        format!("{URI_PREFIX}{}/{}", self.cluster, self.role)
    }

    /// The identity a URI names, if it names one.
    pub fn from_uri(uri: &str) -> Option<Identity> {
        let (cluster, role) = uri.strip_prefix(URI_PREFIX)?.split_once('/')?;
        if cluster.is_empty() || cluster.contains('/') {
            return None;
        }
        Some(Identity::new(cluster, PeerRole::parse(role)?))
    }

    /// The identity a certificate carries: its first URI subject alternative name that names
    /// one. The certificate must already be verified against the cluster's CA.
    pub fn from_certificate(cert: &CertificateDer<'_>) -> Option<Identity> {
        let parsed = webpki::EndEntityCert::try_from(cert).ok()?;
        parsed.valid_uri_names().find_map(Identity::from_uri)
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of cluster {}", self.role, self.cluster)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_round_trip_and_nothing_else_parses() {
        for role in PeerRole::ALL {
            let id = Identity::new("prod-eu", role);
            assert_eq!(Identity::from_uri(&id.uri()), Some(id));
        }
        for bad in [
            "spiffe://switchyard/prod/admin",
            "spiffe://switchyard//worker",
            "spiffe://switchyard/a/b/worker",
            "spiffe://other/prod/worker",
            "https://switchyard/prod/worker",
            "spiffe://switchyard/prod",
        ] {
            assert_eq!(Identity::from_uri(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_certificate_names_its_identity() {
        let id = Identity::new("c1", PeerRole::Planner);
        let mut params = rcgen::CertificateParams::new(vec!["planner.local".to_owned()]).unwrap();
        params.subject_alt_names.push(rcgen::SanType::URI(
            rcgen::string::Ia5String::try_from(id.uri()).unwrap(),
        ));
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(Identity::from_certificate(cert.der()), Some(id));

        let plain = rcgen::CertificateParams::new(vec!["x.local".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        assert_eq!(Identity::from_certificate(plain.der()), None);
    }
}
