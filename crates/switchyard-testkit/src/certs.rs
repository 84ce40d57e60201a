//! Throwaway certificates for tests: a cluster CA made in the test, and member certificates
//! signed by it that carry a Switchyard identity URI (`spiffe://switchyard/<cluster>/<role>`).
//! Nothing here is committed: each test makes its own keys in its own directory.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::TestkitError;

/// A certificate authority that lives as long as the test.
#[derive(Debug)]
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, PEM.
    pub cert_pem: String,
}

/// Where a member's files were written.
#[derive(Debug, Clone)]
pub struct MemberFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

fn cert_error(e: rcgen::Error) -> TestkitError {
    TestkitError::Io {
        context: format!("making a test certificate: {e}"),
        source: std::io::Error::other(e.to_string()),
    }
}

fn write(path: &Path, text: &str) -> Result<(), TestkitError> {
    std::fs::write(path, text).map_err(crate::io_error(format!("writing {}", path.display())))
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Result<Self, TestkitError> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_error)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().map_err(cert_error)?;
        let cert = params.self_signed(&key).map_err(cert_error)?;
        Ok(Self {
            issuer: Issuer::new(params, key),
            cert_pem: cert.pem(),
        })
    }

    /// Issues a certificate for `uri` (an identity URI, or any URI for a foreign one) valid for
    /// `localhost` and 127.0.0.1, and writes `<name>.crt`, `<name>.key` and `ca.crt` into `dir`.
    pub fn issue(
        &self,
        dir: &Path,
        name: &str,
        uri: Option<&str>,
    ) -> Result<MemberFiles, TestkitError> {
        let mut params =
            CertificateParams::new(vec!["localhost".to_owned()]).map_err(cert_error)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params
            .subject_alt_names
            .push(SanType::IpAddress(std::net::IpAddr::from([127, 0, 0, 1])));
        if let Some(uri) = uri {
            params.subject_alt_names.push(SanType::URI(
                rcgen::string::Ia5String::try_from(uri).map_err(cert_error)?,
            ));
        }
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(cert_error)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(cert_error)?;
        let files = MemberFiles {
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
            ca: dir.join("ca.crt"),
        };
        write(&files.cert, &cert.pem())?;
        write(&files.key, &key.serialize_pem())?;
        write(&files.ca, &self.cert_pem)?;
        Ok(files)
    }

    /// The identity URI of `role` in `cluster`, as members' certificates carry it.
    pub fn identity_uri(cluster: &str, role: &str) -> String {
        format!("spiffe://switchyard/{cluster}/{role}")
    }
}
