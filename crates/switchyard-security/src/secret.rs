//! The cluster secret: a shared key every member of a cluster reads from a file (a Kubernetes
//! Secret), used when TLS is off to prove a caller's identity on each gRPC call, and to sign
//! what members write to the registry.
//!
//! A call credential is `v1.<role>.<unix seconds>.<hex HMAC-SHA256>` over the cluster, the role
//! and the time, so it names who calls, in which cluster, and goes stale after
//! [`CREDENTIAL_LIFETIME`]: a captured credential is worth minutes, not forever. (Without TLS the
//! calls themselves can be read on the wire; the secret keeps out whoever cannot, which is what
//! a plain-text control plane can promise. mTLS is the mode for networks that are not trusted.)

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ring::hmac;

use crate::error::SecurityError;
use crate::identity::{Identity, PeerRole};

/// How far a credential's time may be from the receiver's clock, either way.
pub const CREDENTIAL_LIFETIME: Duration = Duration::from_secs(300);

/// Fewest bytes a secret may have (128 bits of a random key written as text needs more).
pub const MIN_SECRET_BYTES: usize = 16;

/// The key, kept only as ring's HMAC key (it has no `Debug` of its bytes).
#[derive(Clone)]
pub struct ClusterSecret {
    key: hmac::Key,
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

/// Why a credential was not accepted; the caller is told only that it was not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    Malformed,
    Stale,
    BadSignature,
}

impl ClusterSecret {
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "a cluster secret needs at least {MIN_SECRET_BYTES} bytes, this one has {}",
                bytes.len()
            ));
        }
        Ok(Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, bytes),
        })
    }

    /// Reads the secret from a file; surrounding white space (a trailing newline) is not part
    /// of it.
    pub fn from_file(path: &Path) -> Result<Self, SecurityError> {
        let text = std::fs::read(path).map_err(|source| SecurityError::Read {
            what: "cluster secret file",
            path: path.to_owned(),
            source,
        })?;
        Self::from_bytes(text.trim_ascii()).map_err(|message| SecurityError::Invalid {
            what: "cluster secret file",
            path: path.to_owned(),
            message,
        })
    }

    /// Hex HMAC-SHA256 of `message` under the secret, within `context` (so a proof made for one
    /// purpose is never valid for another).
    pub fn sign(&self, context: &str, message: &[u8]) -> String {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(context.as_bytes());
        ctx.update(&[0]);
        ctx.update(message);
        hex(ctx.sign().as_ref())
    }

    /// Whether `signature` is [`sign`](Self::sign)'s of `message` in `context` (constant time).
    pub fn verify(&self, context: &str, message: &[u8], signature: &str) -> bool {
        let Some(tag) = unhex(signature) else {
            return false;
        };
        let mut data = Vec::with_capacity(context.len() + 1 + message.len());
        data.extend_from_slice(context.as_bytes());
        data.push(0);
        data.extend_from_slice(message);
        hmac::verify(&self.key, &data, &tag).is_ok()
    }

    /// A call credential for `identity` at `now`.
    pub fn credential(&self, identity: &Identity, now: SystemTime) -> String {
        let secs = unix_secs(now);
        let mac = self.sign(CALL_CONTEXT, call_message(identity, secs).as_bytes());
        format!("v1.{}.{secs}.{mac}", identity.role)
    }

    /// The role a credential proves in `cluster` at `now`.
    pub fn check_credential(
        &self,
        cluster: &str,
        credential: &str,
        now: SystemTime,
    ) -> Result<PeerRole, Rejection> {
        let mut parts = credential.trim().splitn(4, '.');
        let (Some("v1"), Some(role), Some(secs), Some(mac)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Rejection::Malformed);
        };
        let role = PeerRole::parse(role).ok_or(Rejection::Malformed)?;
        let secs: u64 = secs.parse().map_err(|_| Rejection::Malformed)?;
        let identity = Identity::new(cluster, role);
        if !self.verify(CALL_CONTEXT, call_message(&identity, secs).as_bytes(), mac) {
            return Err(Rejection::BadSignature);
        }
        if unix_secs(now).abs_diff(secs) > CREDENTIAL_LIFETIME.as_secs() {
            return Err(Rejection::Stale);
        }
        Ok(role)
    }
}

const CALL_CONTEXT: &str = "switchyard/v1/call";
const ENTRY_CONTEXT: &str = "switchyard/v1/registry-entry";

/// Registry entries signed with the cluster secret: only members can write a worker that
/// members will believe.
impl switchyard_registry::EntryProof for ClusterSecret {
    fn sign(&self, entry: &[u8]) -> String {
        ClusterSecret::sign(self, ENTRY_CONTEXT, entry)
    }

    fn verify(&self, entry: &[u8], proof: &str) -> bool {
        ClusterSecret::verify(self, ENTRY_CONTEXT, entry, proof)
    }
}

fn call_message(identity: &Identity, secs: u64) -> String {
    format!("{}|{}|{secs}", identity.cluster, identity.role)
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

/// Lower-case hex SHA-256 of `bytes` (API key hashes).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(text: &str) -> ClusterSecret {
        ClusterSecret::from_bytes(text.as_bytes()).unwrap()
    }

    #[test]
    fn a_credential_proves_its_role_in_its_cluster_only() {
        let s = secret("0123456789abcdef-secret");
        let now = SystemTime::now();
        let cred = s.credential(&Identity::new("c1", PeerRole::Gateway), now);
        assert_eq!(s.check_credential("c1", &cred, now), Ok(PeerRole::Gateway));
        assert_eq!(
            s.check_credential("c2", &cred, now),
            Err(Rejection::BadSignature)
        );
        // Claiming another role with the same signature fails.
        let forged = cred.replacen("gateway", "planner", 1);
        assert_eq!(
            s.check_credential("c1", &forged, now),
            Err(Rejection::BadSignature)
        );
        let other = secret("another-secret-of-16+");
        assert_eq!(
            other.check_credential("c1", &cred, now),
            Err(Rejection::BadSignature)
        );
    }

    #[test]
    fn credentials_go_stale_and_garbage_is_malformed() {
        let s = secret("0123456789abcdef-secret");
        let then = SystemTime::now();
        let cred = s.credential(&Identity::new("c1", PeerRole::Worker), then);
        let later = then + CREDENTIAL_LIFETIME + Duration::from_secs(2);
        assert_eq!(
            s.check_credential("c1", &cred, later),
            Err(Rejection::Stale)
        );
        for bad in [
            "",
            "v1",
            "v2.worker.1.00",
            "v1.admin.1.00",
            "v1.worker.x.00",
        ] {
            assert_eq!(
                s.check_credential("c1", bad, then),
                Err(Rejection::Malformed),
                "{bad}"
            );
        }
        assert_eq!(
            s.check_credential("c1", "v1.worker.1.zz", then),
            Err(Rejection::BadSignature)
        );
    }

    #[test]
    fn short_secrets_are_refused_and_files_are_trimmed() {
        assert!(ClusterSecret::from_bytes(b"short").is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "0123456789abcdef-secret\n").unwrap();
        let from_file = ClusterSecret::from_file(&path).unwrap();
        let sig = secret("0123456789abcdef-secret").sign("ctx", b"m");
        assert!(from_file.verify("ctx", b"m", &sig));
        assert!(!from_file.verify("other", b"m", &sig));
        std::fs::write(&path, "tiny\n").unwrap();
        let err = ClusterSecret::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("at least 16 bytes"), "{err}");
    }

    #[test]
    fn sha256_is_the_standard_one() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
