//! The etcd key layout (DESIGN.md §3), in one place.
//!
//! Everything lives under `/switchyard/v1/<cluster>/`:
//!
//! | key | value | written by |
//! |---|---|---|
//! | `workers/<id>` | JSON of [`WorkerInfo`](switchyard_core::WorkerInfo), attached to the worker's lease | the worker |
//! | `models/<model>/<id>` | JSON of the worker's id and block size, attached to the same lease: the model's members, so a registration reads one live member of its model instead of every worker (`<model>` escaped: bytes outside `[A-Za-z0-9._-]` as `%XX`) | the worker |
//! | `roles/<id>` | the desired role as plain text: `prefill`, `decode` or `both` | the planner |
//! | `plan` | the planner's latest decision, opaque JSON | the planner |
//! | `gateways/<id>` | JSON of [`ReplicaInfo`](crate::replicas::ReplicaInfo), attached to the replica's lease | the gateway replica |

use switchyard_core::WorkerId;

use crate::RegistryError;

/// Longest accepted cluster name.
pub const MAX_CLUSTER_LEN: usize = 128;

/// Checks a cluster name: 1 to 128 of `[A-Za-z0-9._-]`, so it cannot escape its key prefix.
pub fn validate_cluster(cluster: &str) -> Result<(), RegistryError> {
    let ok = !cluster.is_empty()
        && cluster.len() <= MAX_CLUSTER_LEN
        && cluster
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(RegistryError::InvalidCluster(cluster.to_owned()))
    }
}

/// The keys of one cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    root: String,
}

impl Keys {
    pub fn new(cluster: &str) -> Result<Self, RegistryError> {
        validate_cluster(cluster)?;
        Ok(Self {
            root: format!("/switchyard/v1/{cluster}/"),
        })
    }

    /// `/switchyard/v1/<cluster>/`
    pub fn root(&self) -> &str {
        &self.root
    }

    /// `/switchyard/v1/<cluster>/workers/`
    pub fn workers_prefix(&self) -> String {
        format!("{}workers/", self.root)
    }

    /// `/switchyard/v1/<cluster>/workers/<id>`
    pub fn worker(&self, id: &WorkerId) -> String {
        format!("{}workers/{id}", self.root)
    }

    /// `/switchyard/v1/<cluster>/models/<model>/`, the model's members (`model` escaped, so no
    /// model's prefix is another's).
    pub fn model_members_prefix(&self, model: &str) -> String {
        format!("{}models/{}/", self.root, escape(model))
    }

    /// `/switchyard/v1/<cluster>/models/<model>/<id>`
    pub fn model_member(&self, model: &str, id: &WorkerId) -> String {
        format!("{}{id}", self.model_members_prefix(model))
    }

    /// `/switchyard/v1/<cluster>/roles/<id>`
    pub fn role(&self, id: &WorkerId) -> String {
        format!("{}roles/{id}", self.root)
    }

    /// `/switchyard/v1/<cluster>/gateways/`
    pub fn gateways_prefix(&self) -> String {
        format!("{}gateways/", self.root)
    }

    /// `/switchyard/v1/<cluster>/gateways/<id>` (`id` checked by
    /// [`ReplicaInfo::validate`](crate::replicas::ReplicaInfo::validate)).
    pub fn gateway(&self, id: &str) -> String {
        format!("{}gateways/{id}", self.root)
    }

    /// `/switchyard/v1/<cluster>/plan`
    pub fn plan(&self) -> String {
        format!("{}plan", self.root)
    }

    /// The worker id named by a `workers/<id>` key.
    pub fn worker_id_of(&self, key: &[u8]) -> Result<WorkerId, RegistryError> {
        let key = String::from_utf8_lossy(key);
        let malformed = |reason: String| RegistryError::Malformed {
            key: key.to_string(),
            reason,
        };
        let id = key
            .strip_prefix(&self.workers_prefix())
            .ok_or_else(|| malformed("not under the workers/ prefix".into()))?;
        WorkerId::new(id).map_err(|e| malformed(e.to_string()))
    }
}

/// `text` with every byte outside `[A-Za-z0-9._-]` written `%XX`: one-to-one (`%` itself is
/// escaped) and free of `/`.
fn escape(text: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_design() {
        let keys = Keys::new("prod-1").unwrap();
        let id = WorkerId::new("w1").unwrap();
        assert_eq!(keys.worker(&id), "/switchyard/v1/prod-1/workers/w1");
        assert_eq!(keys.role(&id), "/switchyard/v1/prod-1/roles/w1");
        assert_eq!(keys.plan(), "/switchyard/v1/prod-1/plan");
        assert_eq!(keys.gateway("g-0"), "/switchyard/v1/prod-1/gateways/g-0");
        assert_eq!(keys.worker_id_of(keys.worker(&id).as_bytes()).unwrap(), id);
        assert!(
            keys.worker_id_of(b"/switchyard/v1/prod-1/workers/a b")
                .is_err()
        );
        assert!(keys.worker_id_of(b"/elsewhere/w1").is_err());
        assert_eq!(
            keys.model_member("Qwen/Qwen3-0.6B", &id),
            "/switchyard/v1/prod-1/models/Qwen%2FQwen3-0.6B/w1"
        );
    }

    #[test]
    fn no_model_prefix_holds_another_model() {
        let keys = Keys::new("c").unwrap();
        let models = ["a", "a/b", "a%2Fb", "a b", "ü", "a.b_c-9"];
        for x in models {
            for y in models {
                let (px, py) = (keys.model_members_prefix(x), keys.model_members_prefix(y));
                assert_eq!(x == y, py.starts_with(&px), "{x:?} {y:?}");
            }
        }
    }

    #[test]
    fn cluster_names_cannot_escape_their_prefix() {
        for bad in ["", "a/b", "a b", "ü", &"x".repeat(129)] {
            assert!(Keys::new(bad).is_err(), "{bad:?}");
        }
        assert!(Keys::new("A.b_c-9").is_ok());
    }
}
