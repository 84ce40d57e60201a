//! Proof of who wrote a registry entry.
//!
//! Anyone who can write etcd could otherwise register a "worker" at an address of their choice
//! and have gateways send it prompts. With an [`EntryProof`] (the cluster secret's HMAC), a
//! worker's entry is stored as `{"worker": <WorkerInfo>, "proof": "<hex>"}`, the proof made over
//! the worker's JSON; readers that hold the proof ignore entries without a valid one (logged
//! and counted, see [`Unverified`]), as if they were not there. A gateway replica's entry
//! ([`ReplicaInfo`](crate::ReplicaInfo)) is signed the same way, so no one can have sessions
//! forwarded to an address of their choice.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Signs and checks registry entries.
pub trait EntryProof: Send + Sync + Debug {
    /// A proof of `entry` (the worker's JSON).
    fn sign(&self, entry: &[u8]) -> String;
    /// Whether `proof` is a proof of `entry`.
    fn verify(&self, entry: &[u8], proof: &str) -> bool;
}

/// How many entries a reader ignored for want of a valid proof.
#[derive(Debug, Clone, Default)]
pub struct Unverified(Arc<AtomicU64>);

impl Unverified {
    pub fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn add(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// The field keeps the name it had when only workers were signed, so stored entries stay valid.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SignedEntry<T> {
    worker: T,
    proof: String,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StoredEntry<T> {
    Signed(SignedEntry<T>),
    Plain(T),
}

/// The stored value of `info` (a worker or a gateway replica): signed when there is a proof.
pub(crate) fn encode<T: Serialize + Clone>(
    info: &T,
    proof: Option<&dyn EntryProof>,
) -> Result<Vec<u8>, serde_json::Error> {
    let plain = serde_json::to_vec(info)?;
    match proof {
        None => Ok(plain),
        Some(proof) => serde_json::to_vec(&SignedEntry {
            worker: info.clone(),
            proof: proof.sign(&plain),
        }),
    }
}

/// What a stored value describes; `Ok(None)` when a proof is required and the value has no
/// valid one (counted in `unverified`).
pub(crate) fn decode<T: Serialize + DeserializeOwned>(
    value: &[u8],
    proof: Option<&dyn EntryProof>,
    unverified: &Unverified,
) -> Result<Option<T>, serde_json::Error> {
    let stored: StoredEntry<T> = serde_json::from_slice(value)?;
    let Some(proof) = proof else {
        return Ok(Some(match stored {
            StoredEntry::Signed(signed) => signed.worker,
            StoredEntry::Plain(info) => info,
        }));
    };
    let verified = match stored {
        StoredEntry::Signed(signed) => {
            let plain = serde_json::to_vec(&signed.worker)?;
            proof.verify(&plain, &signed.proof).then_some(signed.worker)
        }
        StoredEntry::Plain(_) => None,
    };
    if verified.is_none() {
        unverified.add();
    }
    Ok(verified)
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::WorkerInfo;

    #[derive(Debug)]
    struct Xor(u8);

    impl EntryProof for Xor {
        fn sign(&self, entry: &[u8]) -> String {
            entry.iter().fold(self.0, |a, b| a ^ b).to_string()
        }
        fn verify(&self, entry: &[u8], proof: &str) -> bool {
            self.sign(entry) == proof
        }
    }

    fn info() -> WorkerInfo {
        WorkerInfo {
            adapters: Vec::new(),
            id: switchyard_core::WorkerId::new("w1").unwrap(),
            address: "127.0.0.1:7000".into(),
            model: "m".into(),
            role: switchyard_core::Role::Both,
            block_size: switchyard_core::BlockSize::new(16).unwrap(),
            kv_capacity_blocks: 10,
            max_context_tokens: 100,
            engine: switchyard_core::EngineKind::Sim,
            incarnation: 7,
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        }
    }

    #[test]
    fn signed_entries_verify_and_forgeries_are_counted_and_ignored() {
        let unverified = Unverified::default();
        let proof = Xor(0x5a);
        let signed = encode(&info(), Some(&proof)).unwrap();
        assert_eq!(
            decode::<WorkerInfo>(&signed, Some(&proof), &unverified).unwrap(),
            Some(info())
        );
        // A plain entry, one signed with another key, and one edited after signing.
        let plain = encode(&info(), None).unwrap();
        let other = encode(&info(), Some(&Xor(1))).unwrap();
        let edited = String::from_utf8(signed.clone())
            .unwrap()
            .replace("127.0.0.1:7000", "10.6.6.6:7000");
        for forged in [&plain, &other, &edited.into_bytes()] {
            assert_eq!(
                decode::<WorkerInfo>(forged, Some(&proof), &unverified).unwrap(),
                None
            );
        }
        assert_eq!(unverified.count(), 3);
        // A reader without the proof takes both forms.
        assert_eq!(
            decode::<WorkerInfo>(&signed, None, &unverified).unwrap(),
            Some(info())
        );
        assert_eq!(
            decode::<WorkerInfo>(&plain, None, &unverified).unwrap(),
            Some(info())
        );
        assert_eq!(unverified.count(), 3);
    }
}
