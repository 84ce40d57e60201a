//! A model's members: `models/<model>/<id>`, one per live worker, on the worker's lease.
//!
//! Every worker of a model must use the model's block size. Checking that against the whole
//! `workers/` list made each registration read every worker: W² keys for a fleet of W starting
//! (10⁸ at 10,000 workers). The rule only needs one live worker of the same model (a witness):
//! all of them agree already. So each worker also writes its member entry (its id and block
//! size) beside its `workers/<id>` entry, in the same transaction and on the same lease, and a
//! registration reads at most two members of its model (one that is not itself), checks the
//! block size against the witness's, and puts on the condition that the witness's entry is still
//! there. With no readable witness (the first worker of a model, a fleet registered before
//! member entries existed, an entry that fails its proof), registration lists every worker as
//! it always did.

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, TxnOp};
use serde::{Deserialize, Serialize};
use switchyard_core::{BlockSize, WorkerId, WorkerInfo};

use super::Conn;
use crate::RegistryError;

/// What a member entry says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Member {
    pub(crate) worker: WorkerId,
    pub(crate) block_size: BlockSize,
}

impl Member {
    fn of(info: &WorkerInfo) -> Self {
        Self {
            worker: info.id.clone(),
            block_size: info.block_size,
        }
    }

    /// Refuses `info` when its block size is not this witness's.
    pub(crate) fn admits(&self, info: &WorkerInfo) -> Result<(), RegistryError> {
        if self.block_size == info.block_size {
            return Ok(());
        }
        Err(RegistryError::BlockSizeMismatch {
            model: info.model.clone(),
            worker: info.id.clone(),
            requested: info.block_size,
            existing_worker: self.worker.clone(),
            existing: self.block_size,
        })
    }

    /// The condition that this witness is still registered.
    pub(crate) fn still_there(&self, conn: &Conn, model: &str) -> Compare {
        Compare::version(
            conn.keys.model_member(model, &self.worker),
            CompareOp::Greater,
            0,
        )
    }
}

/// A worker's member entry, encoded (and signed, with a proof) ahead of the lease it goes on.
pub(crate) struct Entry {
    key: String,
    value: Vec<u8>,
}

impl Entry {
    pub(crate) fn of(conn: &Conn, info: &WorkerInfo) -> Result<Self, RegistryError> {
        let key = conn.keys.model_member(&info.model, &info.id);
        let value =
            crate::proof::encode(&Member::of(info), conn.proof.as_deref()).map_err(|source| {
                RegistryError::Encode {
                    key: key.clone(),
                    source,
                }
            })?;
        Ok(Self { key, value })
    }

    /// The put of this entry under `lease`.
    pub(crate) fn put(&self, lease: i64) -> TxnOp {
        TxnOp::put(
            self.key.clone(),
            self.value.clone(),
            Some(PutOptions::new().with_lease(lease)),
        )
    }
}

/// The delete of `info`'s member entry (its model changed).
pub(crate) fn delete(conn: &Conn, info: &WorkerInfo) -> TxnOp {
    TxnOp::delete(conn.keys.model_member(&info.model, &info.id), None)
}

/// A live member of `model` other than `except`, from one read of at most two entries; `None`
/// when there is none, or when the one found is not a valid entry for its key (then the caller
/// checks against every worker instead).
pub(crate) async fn witness(
    conn: &Conn,
    model: &str,
    except: &WorkerId,
) -> Result<Option<Member>, RegistryError> {
    let prefix = conn.keys.model_members_prefix(model);
    let mut client = conn.client.clone();
    let response = conn
        .call(
            "read a member of the model",
            client.get(
                prefix.as_str(),
                Some(GetOptions::new().with_prefix().with_limit(2)),
            ),
        )
        .await?;
    let own = conn.keys.model_member(model, except);
    let Some(kv) = response.kvs().iter().find(|kv| kv.key() != own.as_bytes()) else {
        return Ok(None);
    };
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    let member =
        match crate::proof::decode::<Member>(kv.value(), conn.proof.as_deref(), &conn.unverified) {
            Ok(Some(member)) if key == format!("{prefix}{}", member.worker) => Some(member),
            Ok(_) | Err(_) => None,
        };
    if member.is_none() {
        tracing::warn!(%key, "member entry unreadable; checking against every worker instead");
    }
    Ok(member)
}
