//! API keys for `/v1`: hashed keys in a file, each naming the tenant its requests are shared
//! fairly as (see [`crate::access::admission`]).
//!
//! The file (a Kubernetes Secret mounted as a file works the same) holds one key per line:
//! `<sha256 of the key, hex> <tenant>`; blank lines and `#` comments are skipped. Keys are
//! never stored in clear: `printf %s "$KEY" | sha256sum` gives the hash. The file is re-read
//! when it changes, so keys are added and revoked without a restart; a broken edit keeps the
//! previous list (and says so in the log).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use switchyard_security::SecurityError;
use switchyard_security::secret::sha256_hex;
use switchyard_security::tls::Reloading;

/// The keys and their tenants, by hash.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApiKeys {
    tenants: HashMap<String, String>,
}

impl ApiKeys {
    /// Parses the file's text; the error names the line.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut tenants = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let (Some(hash), Some(tenant), None) = (fields.next(), fields.next(), fields.next())
            else {
                return Err(format!("line {}: expected `<sha256 hex> <tenant>`", i + 1));
            };
            let hash = hash
                .strip_prefix("sha256:")
                .unwrap_or(hash)
                .to_ascii_lowercase();
            if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!(
                    "line {}: {hash:?} is not a SHA-256 in hex (64 characters)",
                    i + 1
                ));
            }
            if tenants.insert(hash, tenant.to_owned()).is_some() {
                return Err(format!("line {}: the same key is listed twice", i + 1));
            }
        }
        Ok(Self { tenants })
    }

    pub fn read(path: &Path) -> Result<Self, SecurityError> {
        let text = std::fs::read_to_string(path).map_err(|source| SecurityError::Read {
            what: "API key file",
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|message| SecurityError::Invalid {
            what: "API key file",
            path: path.to_owned(),
            message,
        })
    }

    /// The tenant of a presented key, if it is one of the keys.
    pub fn tenant(&self, key: &str) -> Option<&str> {
        self.tenants
            .get(&sha256_hex(key.as_bytes()))
            .map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.tenants.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }
}

/// The key list of a file, re-read when the file changes.
#[derive(Debug)]
pub struct ApiKeyFile {
    keys: Reloading<ApiKeys>,
}

impl ApiKeyFile {
    pub fn open(path: PathBuf) -> Result<Self, SecurityError> {
        let read_from = path.clone();
        let keys = Reloading::watching("API key file", vec![path], move || {
            ApiKeys::read(&read_from)
        })?;
        Ok(Self { keys })
    }

    /// The tenant of a presented key under the file's current list.
    pub fn tenant(&self, key: &str) -> Option<String> {
        self.keys.get().tenant(key).map(str::to_owned)
    }
}

/// Why a `/v1` request was not let in (401).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyRefusal {
    Missing,
    Wrong,
}

/// The bearer key of an `Authorization` header value.
pub fn bearer(authorization: Option<&str>) -> Option<&str> {
    authorization
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .filter(|k| !k.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "sk-test-0123456789";

    fn line(key: &str, tenant: &str) -> String {
        format!("{} {tenant}\n", sha256_hex(key.as_bytes()))
    }

    #[test]
    fn keys_map_to_their_tenants_and_nothing_else_gets_in() {
        let text = format!(
            "# team keys\n\n{}{}",
            line(KEY, "team-a"),
            line("sk-other", "team-b")
        );
        let keys = ApiKeys::parse(&text).unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys.tenant(KEY), Some("team-a"));
        assert_eq!(keys.tenant("sk-other"), Some("team-b"));
        assert_eq!(keys.tenant("sk-test-012345678"), None);
        assert_eq!(keys.tenant(""), None);
        // The hash itself is not a key.
        assert_eq!(keys.tenant(&sha256_hex(KEY.as_bytes())), None);
    }

    #[test]
    fn bad_lines_are_named() {
        for (text, expected) in [
            ("abc team\n", "line 1"),
            (
                "# c\nnot-hex-at-all-but-long-enough-to-be-a-hash-aaaaaaaaaaaaaaaaaaaaaaaa x\n",
                "line 2",
            ),
            (&line(KEY, "a b"), "line 1"),
            (&format!("{}{}", line(KEY, "a"), line(KEY, "b")), "twice"),
        ] {
            let err = ApiKeys::parse(text).unwrap_err();
            assert!(err.contains(expected), "{text}: {err}");
        }
        let upper = format!("sha256:{} t\n", sha256_hex(KEY.as_bytes()).to_uppercase());
        assert_eq!(ApiKeys::parse(&upper).unwrap().tenant(KEY), Some("t"));
    }

    #[test]
    fn bearer_keys_are_read_from_the_header() {
        assert_eq!(bearer(Some("Bearer sk-1")), Some("sk-1"));
        assert_eq!(bearer(Some("bearer  sk-1 ")), Some("sk-1"));
        assert_eq!(bearer(Some("Basic abc")), None);
        assert_eq!(bearer(Some("Bearer ")), None);
        assert_eq!(bearer(None), None);
    }

    #[tokio::test]
    async fn an_edited_file_is_reread_and_a_broken_edit_keeps_the_old_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, line(KEY, "team-a")).unwrap();
        let file = ApiKeyFile::open(path.clone()).unwrap();
        assert_eq!(file.tenant(KEY).as_deref(), Some("team-a"));
        let wait = switchyard_security::tls::RELOAD_CHECK + std::time::Duration::from_millis(50);
        std::fs::write(&path, "garbage\n").unwrap();
        tokio::time::sleep(wait).await;
        assert_eq!(file.tenant(KEY).as_deref(), Some("team-a"));
        std::fs::write(&path, line("sk-new", "team-c")).unwrap();
        tokio::time::sleep(wait).await;
        assert_eq!(file.tenant(KEY), None, "revoked");
        assert_eq!(file.tenant("sk-new").as_deref(), Some("team-c"));
    }
}
