//! The etcd backend.
//!
//! - This file: connecting, listing, registering (one transaction that checks the admission
//!   rules against the exact revision it listed), roles and the plan.
//! - `members`: a model's member entries, which let a registration check the block-size rule
//!   against one live worker of its model instead of listing them all.
//! - `lease`: the keep-alive task of a [`Registration`], which rides out etcd outages and
//!   re-registers under a new lease when the old one expired meanwhile.
//! - `watch`: the task feeding a [`WorkerWatch`], which resumes after a broken stream by
//!   listing again and emitting the differences (a worker the new list lacks is removed only
//!   if it is still missing [`RESYNC_REMOVAL_GRACE`] later).
//!
//! Values under `workers/` that are not a valid [`WorkerInfo`] for their key are skipped with a
//! warning, so one bad write cannot take the cluster's membership down.

mod lease;
mod members;
mod replicas;
pub mod users;
mod watch;

pub use watch::RESYNC_REMOVAL_GRACE;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use switchyard_core::{Role, WorkerId, WorkerInfo};
use tokio::sync::mpsc;

use crate::keys::Keys;
use crate::proof::{EntryProof, Unverified};
use crate::{
    OwnedTask, Registration, Registry, RegistryError, WorkerWatch, check_admission, check_ttl,
};

/// How long [`EtcdRegistry::connect`] waits for etcd before giving up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long any single etcd request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a registration retries the compare-and-put when other workers keep registering.
const REGISTER_ATTEMPTS: usize = 10;
/// Entries read per request when listing a prefix. One answer must stay under gRPC's 4 MiB
/// message limit: 10,000 worker entries were 4.9 MB in one, and no gateway could start.
const LIST_PAGE: i64 = 1_000;

/// A [`Registry`] stored in etcd under `/switchyard/v1/<cluster>/` (see [`crate::keys`]).
#[derive(Clone)]
pub struct EtcdRegistry {
    conn: Conn,
}

impl std::fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRegistry")
            .field("root", &self.conn.keys.root())
            .finish_non_exhaustive()
    }
}

/// How to authenticate to etcd: its own users, and TLS (the server checked against a CA, and a
/// client certificate when etcd asks for one). Empty: plain text, no user.
#[derive(Clone, Default)]
pub struct EtcdAuth {
    /// User name and password (etcd's `auth enable`).
    pub user: Option<(String, String)>,
    /// CA (PEM) of etcd's server certificate; turns TLS on (endpoints become `https://`).
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate chain and key (PEM).
    pub identity_pem: Option<(Vec<u8>, Vec<u8>)>,
    /// Signs this process's worker entries and ignores others' without a valid proof.
    pub proof: Option<Arc<dyn EntryProof>>,
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("user", &self.user.as_ref().map(|(name, _)| name))
            .field("tls", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity_pem.is_some())
            .field("proof", &self.proof.is_some())
            .finish()
    }
}

impl EtcdAuth {
    fn options(&self) -> ConnectOptions {
        let mut options = ConnectOptions::new();
        if let Some((name, password)) = &self.user {
            options = options.with_user(name.clone(), password.clone());
        }
        if let Some(ca) = &self.ca_pem {
            let mut tls = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(ca));
            if let Some((cert, key)) = &self.identity_pem {
                tls = tls.identity(etcd_client::Identity::from_pem(cert, key));
            }
            options = options.with_tls(tls);
        }
        options
    }

    /// `endpoints` with the scheme TLS asks for (`host:port` and `http://` become `https://`).
    fn endpoints(&self, endpoints: &[String]) -> Vec<String> {
        if self.ca_pem.is_none() {
            return endpoints.to_vec();
        }
        endpoints
            .iter()
            .map(|e| {
                let bare = e
                    .strip_prefix("http://")
                    .or_else(|| e.strip_prefix("https://"))
                    .unwrap_or(e);
                format!("https://{bare}")
            })
            .collect()
    }
}

impl EtcdRegistry {
    /// How many entries this registry ignored for want of a valid proof.
    pub fn unverified(&self) -> Unverified {
        self.conn.unverified.clone()
    }

    /// Connects to etcd and checks that it answers, within [`CONNECT_TIMEOUT`].
    pub async fn connect(endpoints: &[String], cluster: &str) -> Result<Self, RegistryError> {
        Self::connect_with(endpoints, cluster, &EtcdAuth::default()).await
    }

    /// [`connect`](Self::connect) with etcd's users and TLS.
    pub async fn connect_with(
        endpoints: &[String],
        cluster: &str,
        auth: &EtcdAuth,
    ) -> Result<Self, RegistryError> {
        let keys = Keys::new(cluster)?;
        let endpoints = auth.endpoints(endpoints);
        let options = auth
            .options()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        let action = "connect";
        let client =
            tokio::time::timeout(CONNECT_TIMEOUT, Client::connect(&endpoints, Some(options)))
                .await
                .map_err(|_| RegistryError::Timeout {
                    action,
                    after: CONNECT_TIMEOUT,
                })?
                .map_err(|source| RegistryError::Unavailable { action, source })?;
        let conn = Conn {
            client,
            keys,
            timeout: REQUEST_TIMEOUT,
            proof: auth.proof.clone(),
            unverified: Unverified::default(),
        };
        // The client connects lazily; make sure someone answers before reporting success.
        let mut client = conn.client.clone();
        let root = conn.keys.root().to_owned();
        conn.call(
            "reach etcd",
            client.get(
                root,
                Some(GetOptions::new().with_prefix().with_count_only()),
            ),
        )
        .await?;
        Ok(Self { conn })
    }

    /// The key layout this registry uses.
    pub fn keys(&self) -> &Keys {
        &self.conn.keys
    }
}

/// What every etcd task needs: a client, the keys and the request timeout.
#[derive(Clone)]
pub(crate) struct Conn {
    client: Client,
    keys: Keys,
    timeout: Duration,
    /// Signs this process's entries and checks everyone's, when the cluster has a secret.
    proof: Option<Arc<dyn EntryProof>>,
    unverified: Unverified,
}

impl Conn {
    /// Runs one etcd request under the request timeout, naming `action` in errors.
    async fn call<T>(
        &self,
        action: &'static str,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, RegistryError> {
        tokio::time::timeout(self.timeout, request)
            .await
            .map_err(|_| RegistryError::Timeout {
                action,
                after: self.timeout,
            })?
            .map_err(|source| RegistryError::Unavailable { action, source })
    }

    /// [`call`](Self::call) for a request about `lease`: etcd's "lease not found" comes back as
    /// [`RegistryError::LeaseNotFound`], not as an outage.
    async fn call_on_lease<T>(
        &self,
        action: &'static str,
        lease: i64,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, RegistryError> {
        tokio::time::timeout(self.timeout, request)
            .await
            .map_err(|_| RegistryError::Timeout {
                action,
                after: self.timeout,
            })?
            .map_err(|source| RegistryError::from_lease_call(action, lease, source))
    }

    /// Every entry under `prefix` as of one revision, and that revision: read [`LIST_PAGE`]
    /// entries at a time, each page after the first at the first one's revision, so the pages
    /// are one consistent list however many there are.
    async fn list_prefix(
        &self,
        action: &'static str,
        prefix: String,
    ) -> Result<(Vec<KeyValue>, i64), RegistryError> {
        let end = prefix_end(prefix.as_bytes());
        let mut from = prefix.into_bytes();
        let mut revision = 0;
        let mut entries = Vec::new();
        loop {
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(LIST_PAGE);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            let mut client = self.client.clone();
            let mut response = self
                .call(action, client.get(from.clone(), Some(options)))
                .await?;
            if revision == 0 {
                revision = response.header().map_or(0, |h| h.revision());
            }
            let more = response.more();
            let page = response.take_kvs();
            let Some(last) = page.last() else { break };
            from = last.key().to_vec();
            from.push(0);
            entries.extend(page);
            if !more {
                break;
            }
        }
        Ok((entries, revision))
    }

    /// The valid workers and the revision they were read at.
    async fn list_workers(&self) -> Result<(BTreeMap<WorkerId, WorkerInfo>, i64), RegistryError> {
        let (entries, revision) = self
            .list_prefix("list workers", self.keys.workers_prefix())
            .await?;
        let mut workers = BTreeMap::new();
        for kv in &entries {
            match parse_worker(self, kv) {
                Ok(info) => {
                    workers.insert(info.id.clone(), info);
                }
                Err(error) => tracing::warn!(%error, "skipping worker entry"),
            }
        }
        Ok((workers, revision))
    }

    /// Opens a watch on `workers/` starting at `revision`.
    async fn watch_workers_from(
        &self,
        revision: i64,
    ) -> Result<etcd_client::WatchStream, RegistryError> {
        let mut client = self.client.clone();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision);
        self.call(
            "watch workers",
            client.watch(self.keys.workers_prefix(), Some(options)),
        )
        .await
    }

    async fn get_value(
        &self,
        action: &'static str,
        key: String,
    ) -> Result<Option<Vec<u8>>, RegistryError> {
        let mut client = self.client.clone();
        let response = self.call(action, client.get(key, None)).await?;
        Ok(response.kvs().first().map(|kv| kv.value().to_vec()))
    }

    async fn put_value(
        &self,
        action: &'static str,
        key: String,
        value: Vec<u8>,
    ) -> Result<(), RegistryError> {
        let mut client = self.client.clone();
        self.call(action, client.put(key, value, None)).await?;
        Ok(())
    }
}

/// Reads a `workers/<id>` entry, insisting that the value describes the worker its key names.
/// With a proof, an entry without a valid one is [`RegistryError::Unverified`].
pub(crate) fn parse_worker(conn: &Conn, kv: &KeyValue) -> Result<WorkerInfo, RegistryError> {
    let id = conn.keys.worker_id_of(kv.key())?;
    let key = || String::from_utf8_lossy(kv.key()).into_owned();
    let malformed = |reason: String| RegistryError::Malformed { key: key(), reason };
    let info =
        crate::proof::decode::<WorkerInfo>(kv.value(), conn.proof.as_deref(), &conn.unverified)
            .map_err(|e| malformed(format!("not worker info: {e}")))?
            .ok_or_else(|| RegistryError::Unverified { key: key() })?;
    if info.id != id {
        return Err(malformed(format!("value names worker {}", info.id)));
    }
    info.validate().map_err(|e| malformed(e.to_string()))?;
    Ok(info)
}

fn encode_worker(conn: &Conn, info: &WorkerInfo) -> Result<Vec<u8>, RegistryError> {
    crate::proof::encode(info, conn.proof.as_deref()).map_err(|source| RegistryError::Encode {
        key: conn.keys.worker(&info.id),
        source,
    })
}

/// The end of the range of keys starting with `prefix` (etcd's rule: the prefix with its last
/// byte below 0xff incremented, the 0xff bytes after it dropped; `\0` for everything).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// etcd leases count whole seconds; round up so the lease is never shorter than asked.
fn ttl_seconds(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs).unwrap_or(i64::MAX)
}

/// What must still hold when a registration's put lands for the admission check made against
/// `live` (listed at `revision`) to stay true; the id's own condition is compared beside it.
///
/// A live worker of the same model (a witness) fixes the model's block size: a concurrent
/// registration with another size sees it too and is refused, so the put only needs the
/// witness still registered. Only the first worker of a model, with no witness, needs nothing
/// under `workers/` to have changed since the list. Comparing the whole prefix for every
/// registration made concurrent registrations fail each other: a fleet of 250 starting at once
/// retried until its leases expired. A take-over (`replaces`, rare) keeps the whole-prefix
/// condition, which also pins the entry it replaces.
fn admitted_as_seen(
    conn: &Conn,
    info: &WorkerInfo,
    live: &BTreeMap<WorkerId, WorkerInfo>,
    revision: i64,
    replaces: bool,
) -> Compare {
    let witness = live
        .values()
        .find(|w| w.id != info.id && w.model == info.model)
        .filter(|_| !replaces);
    match witness {
        Some(witness) => Compare::version(conn.keys.worker(&witness.id), CompareOp::Greater, 0),
        None => Compare::mod_revision(conn.keys.workers_prefix(), CompareOp::Less, revision + 1)
            .with_prefix(),
    }
}

impl EtcdRegistry {
    /// Registers `info`; with `stale`, in place of that exact registration of its id.
    async fn register_replacing(
        &self,
        info: WorkerInfo,
        ttl: Duration,
        stale: Option<&WorkerInfo>,
    ) -> Result<Registration, RegistryError> {
        info.validate().map_err(RegistryError::InvalidWorkerInfo)?;
        check_ttl(ttl)?;
        let conn = &self.conn;
        let key = conn.keys.worker(&info.id);
        let value = encode_worker(conn, &info)?;
        let member = members::Entry::of(conn, &info)?;
        let ttl_secs = ttl_seconds(ttl);
        let mut client = conn.client.clone();
        let lease_id = conn
            .call("grant a lease", client.lease_grant(ttl_secs, None))
            .await?
            .id();
        let outcome = async {
            for _ in 0..REGISTER_ATTEMPTS {
                if stale.is_none() {
                    match self
                        .register_beside_witness(&info, &value, &member, lease_id)
                        .await?
                    {
                        Witnessed::Registered => return Ok(()),
                        Witnessed::Gone => continue,
                        Witnessed::None => {}
                    }
                }
                let (live, revision) = conn.list_workers().await?;
                let replaces = match (live.get(&info.id), stale) {
                    (Some(current), Some(stale)) if current == stale => true,
                    (Some(_), _) => return Err(RegistryError::AlreadyRegistered(info.id.clone())),
                    (None, _) => false,
                };
                check_admission(&info, live.values(), replaces)?;
                let id_as_seen = if replaces {
                    Compare::version(key.clone(), CompareOp::Greater, 0)
                } else {
                    Compare::version(key.clone(), CompareOp::Equal, 0)
                };
                let txn = Txn::new()
                    .when([
                        id_as_seen,
                        admitted_as_seen(conn, &info, &live, revision, replaces),
                    ])
                    .and_then([
                        TxnOp::put(
                            key.clone(),
                            value.clone(),
                            Some(PutOptions::new().with_lease(lease_id)),
                        ),
                        member.put(lease_id),
                    ]);
                let mut client = conn.client.clone();
                if conn
                    .call("register a worker", client.txn(txn))
                    .await?
                    .succeeded()
                {
                    return Ok(());
                }
            }
            Err(RegistryError::Timeout {
                action: "register a worker while others kept registering",
                after: conn.timeout,
            })
        }
        .await;
        if let Err(error) = outcome {
            let mut client = conn.client.clone();
            if let Err(revoke_error) = conn
                .call("revoke a lease", client.lease_revoke(lease_id))
                .await
            {
                tracing::debug!(%revoke_error, "unused lease left to expire");
            }
            return Err(error);
        }
        tracing::info!(worker = %info.id, lease = lease_id, ttl_secs, "worker registered");
        Ok(Registration::new(Box::new(lease::EtcdLease::start(
            conn.clone(),
            info,
            lease_id,
            ttl_secs,
        ))))
    }
}

/// How a registration beside a witness of its model went.
enum Witnessed {
    Registered,
    /// The witness left between the read and the put: try again.
    Gone,
    /// No readable witness: check against every worker.
    None,
}

impl EtcdRegistry {
    /// Registers `info` (encoded as `value`) under `lease` on the word of one live worker of its
    /// model (`members`): its block size must match, and the put happens only while the
    /// witness is still registered and the id is free.
    async fn register_beside_witness(
        &self,
        info: &WorkerInfo,
        value: &[u8],
        member: &members::Entry,
        lease: i64,
    ) -> Result<Witnessed, RegistryError> {
        let conn = &self.conn;
        let Some(witness) = members::witness(conn, &info.model, &info.id).await? else {
            return Ok(Witnessed::None);
        };
        witness.admits(info)?;
        let key = conn.keys.worker(&info.id);
        let txn = Txn::new()
            .when([
                Compare::version(key.clone(), CompareOp::Equal, 0),
                witness.still_there(conn, &info.model),
            ])
            .and_then([
                TxnOp::put(
                    key.clone(),
                    value.to_vec(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                member.put(lease),
            ])
            .or_else([TxnOp::get(key, None)]);
        let mut client = conn.client.clone();
        let response = conn.call("register a worker", client.txn(txn)).await?;
        if response.succeeded() {
            return Ok(Witnessed::Registered);
        }
        let taken = response
            .op_responses()
            .iter()
            .any(|op| matches!(op, etcd_client::TxnOpResponse::Get(get) if !get.kvs().is_empty()));
        if taken {
            return Err(RegistryError::AlreadyRegistered(info.id.clone()));
        }
        Ok(Witnessed::Gone)
    }
}

#[async_trait]
impl crate::Discovery for EtcdRegistry {
    async fn discover(&self) -> Result<WorkerWatch, RegistryError> {
        self.watch_workers().await
    }
}

#[async_trait]
impl Registry for EtcdRegistry {
    async fn register(
        &self,
        info: WorkerInfo,
        ttl: Duration,
    ) -> Result<Registration, RegistryError> {
        self.register_replacing(info, ttl, None).await
    }

    async fn take_over(
        &self,
        info: WorkerInfo,
        ttl: Duration,
        stale: &WorkerInfo,
    ) -> Result<Registration, RegistryError> {
        self.register_replacing(info, ttl, Some(stale)).await
    }

    async fn list_workers(&self) -> Result<Vec<WorkerInfo>, RegistryError> {
        Ok(self.conn.list_workers().await?.0.into_values().collect())
    }

    async fn worker(&self, id: &WorkerId) -> Result<Option<WorkerInfo>, RegistryError> {
        let mut client = self.conn.client.clone();
        let response = self
            .conn
            .call("read a worker", client.get(self.conn.keys.worker(id), None))
            .await?;
        response
            .kvs()
            .first()
            .map(|kv| parse_worker(&self.conn, kv))
            .transpose()
    }

    async fn watch_workers(&self) -> Result<WorkerWatch, RegistryError> {
        let (known, revision) = self.conn.list_workers().await?;
        let stream = self.conn.watch_workers_from(revision + 1).await?;
        let initial = known.values().cloned().collect();
        let (changes_tx, changes_rx) = mpsc::unbounded_channel();
        let conn = self.conn.clone();
        let feeder =
            OwnedTask::spawn(move |cancel| watch::feed(conn, known, stream, changes_tx, cancel));
        Ok(WorkerWatch::new(initial, changes_rx, Some(feeder)))
    }

    async fn set_desired_role(&self, id: &WorkerId, role: Role) -> Result<(), RegistryError> {
        let key = self.conn.keys.role(id);
        self.conn
            .put_value("set a desired role", key, role.as_str().as_bytes().to_vec())
            .await
    }

    async fn desired_role(&self, id: &WorkerId) -> Result<Option<Role>, RegistryError> {
        let key = self.conn.keys.role(id);
        let Some(value) = self
            .conn
            .get_value("read a desired role", key.clone())
            .await?
        else {
            return Ok(None);
        };
        String::from_utf8_lossy(&value)
            .parse::<Role>()
            .map(Some)
            .map_err(|e| RegistryError::Malformed {
                key,
                reason: e.to_string(),
            })
    }

    async fn put_plan(&self, plan: &serde_json::Value) -> Result<(), RegistryError> {
        let key = self.conn.keys.plan();
        let value = serde_json::to_vec(plan).map_err(|source| RegistryError::Encode {
            key: key.clone(),
            source,
        })?;
        self.conn.put_value("write the plan", key, value).await
    }

    async fn plan(&self) -> Result<Option<serde_json::Value>, RegistryError> {
        let key = self.conn.keys.plan();
        let Some(value) = self.conn.get_value("read the plan", key.clone()).await? else {
            return Ok(None);
        };
        serde_json::from_slice(&value)
            .map(Some)
            .map_err(|e| RegistryError::Malformed {
                key,
                reason: format!("not json: {e}"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        assert_eq!(ttl_seconds(Duration::from_secs(2)), 2);
        assert_eq!(ttl_seconds(Duration::from_millis(2001)), 3);
    }

    #[test]
    fn a_prefix_ends_where_etcd_says() {
        assert_eq!(prefix_end(b"/a/workers/"), b"/a/workers0");
        assert_eq!(prefix_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
        assert_eq!(prefix_end(b""), b"\0");
    }
}
