//! Where a gateway learns which workers exist: the [`Discovery`] capability.
//!
//! Every [`Registry`](crate::Registry) is a discovery source (etcd: the workers' leased
//! entries). Others live outside this crate (the gateway's Kubernetes pod watch) and hand
//! their changes over through [`WorkerWatch::from_channel`]. [`Merged`] follows several
//! sources as one, so a gateway can find workers in etcd and in Kubernetes at once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use async_trait::async_trait;
use switchyard_core::WorkerId;
use tokio::sync::mpsc;

use crate::{OwnedTask, RegistryError, WorkerChange, WorkerWatch};

/// A source of worker membership: the live workers and every change after that snapshot.
#[async_trait]
pub trait Discovery: Send + Sync + std::fmt::Debug {
    /// The live workers plus every change after that snapshot, with no gap between the two.
    /// The watch ends (its `next` answers `None`) when the source can no longer follow; the
    /// caller discovers again.
    async fn discover(&self) -> Result<WorkerWatch, RegistryError>;
}

/// Several sources followed as one: a worker is live while any source lists it (a worker
/// both registered in etcd and found as a pod is one worker). The merged watch ends when
/// any of its sources' watches ends, so the caller re-lists them all.
#[derive(Debug)]
pub struct Merged {
    sources: Vec<Arc<dyn Discovery>>,
}

impl Merged {
    pub fn new(sources: Vec<Arc<dyn Discovery>>) -> Self {
        Self { sources }
    }
}

#[async_trait]
impl Discovery for Merged {
    async fn discover(&self) -> Result<WorkerWatch, RegistryError> {
        let mut watches = Vec::with_capacity(self.sources.len());
        for source in &self.sources {
            watches.push(source.discover().await?);
        }
        let mut holders: BTreeMap<WorkerId, BTreeSet<usize>> = BTreeMap::new();
        let mut initial = BTreeMap::new();
        for (index, watch) in watches.iter_mut().enumerate() {
            for info in std::mem::take(&mut watch.initial) {
                holders.entry(info.id.clone()).or_default().insert(index);
                initial.insert(info.id.clone(), info);
            }
        }
        let (tagged_tx, tagged_rx) = mpsc::unbounded_channel();
        let (changes_tx, changes_rx) = mpsc::unbounded_channel();
        let feeder = OwnedTask::spawn(move |cancel| async move {
            let forwarders = tokio_util::task::TaskTracker::new();
            for (index, mut watch) in watches.into_iter().enumerate() {
                let tagged_tx = tagged_tx.clone();
                let cancel = cancel.clone();
                forwarders.spawn(async move {
                    loop {
                        let change = tokio::select! {
                            () = cancel.cancelled() => return,
                            change = watch.next() => change,
                        };
                        let end = change.is_none();
                        if tagged_tx.send((index, change)).is_err() || end {
                            return;
                        }
                    }
                });
            }
            drop(tagged_tx);
            merge(holders, tagged_rx, changes_tx).await;
            cancel.cancel();
            forwarders.close();
            forwarders.wait().await;
        });
        Ok(WorkerWatch::new(
            initial.into_values().collect(),
            changes_rx,
            Some(feeder),
        ))
    }
}

/// Applies each source's changes to who holds which worker, and passes on what changes the
/// union: the first holder adds, the last one to let go removes. Returns when a source's watch
/// ends or the consumer is gone.
async fn merge(
    mut holders: BTreeMap<WorkerId, BTreeSet<usize>>,
    mut tagged_rx: mpsc::UnboundedReceiver<(usize, Option<WorkerChange>)>,
    changes_tx: mpsc::UnboundedSender<WorkerChange>,
) {
    while let Some((index, change)) = tagged_rx.recv().await {
        let out = match change {
            None => return,
            Some(WorkerChange::Added(info) | WorkerChange::Updated(info)) => {
                let held = holders.entry(info.id.clone()).or_default();
                let first = held.is_empty();
                held.insert(index);
                if first {
                    WorkerChange::Added(info)
                } else {
                    WorkerChange::Updated(info)
                }
            }
            Some(WorkerChange::Removed(id)) => {
                let Some(held) = holders.get_mut(&id) else {
                    continue;
                };
                held.remove(&index);
                if !held.is_empty() {
                    continue;
                }
                holders.remove(&id);
                WorkerChange::Removed(id)
            }
        };
        if changes_tx.send(out).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryRegistry, Registry};
    use std::time::Duration;
    use switchyard_core::{BlockSize, EngineKind, Role, WorkerInfo};

    fn worker(id: &str) -> WorkerInfo {
        WorkerInfo {
            adapters: Vec::new(),
            id: WorkerId::new(id).unwrap(),
            address: format!("127.0.0.1:{}", 1000 + id.len()),
            model: "m".into(),
            role: Role::Both,
            block_size: BlockSize::new(16).unwrap(),
            kv_capacity_blocks: 10,
            max_context_tokens: 100,
            engine: EngineKind::Sim,
            incarnation: 0,
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        }
    }

    async fn next(watch: &mut WorkerWatch) -> Option<WorkerChange> {
        tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .expect("a change within 5 s")
    }

    #[tokio::test]
    async fn a_worker_in_two_sources_stays_until_both_let_go() {
        let etcd_like = Arc::new(MemoryRegistry::new());
        let pods_like = Arc::new(MemoryRegistry::new());
        let ttl = Duration::from_secs(30);
        let in_both_a = etcd_like.register(worker("both"), ttl).await.unwrap();
        let in_both_b = pods_like.register(worker("both"), ttl).await.unwrap();
        let _only = etcd_like.register(worker("only"), ttl).await.unwrap();
        let merged = Merged::new(vec![etcd_like.clone(), pods_like.clone()]);
        let mut watch = merged.discover().await.unwrap();
        let ids: Vec<_> = watch.initial.iter().map(|w| w.id.to_string()).collect();
        assert_eq!(ids, ["both", "only"]);

        in_both_a.deregister().await.unwrap();
        let late = pods_like.register(worker("late"), ttl).await.unwrap();
        // The first source letting go of "both" changes nothing; "late" is new.
        assert_eq!(
            next(&mut watch).await,
            Some(WorkerChange::Added(worker("late")))
        );
        in_both_b.deregister().await.unwrap();
        let gone = WorkerChange::Removed(WorkerId::new("both").unwrap());
        assert_eq!(next(&mut watch).await, Some(gone));
        late.deregister().await.unwrap();
        let gone = WorkerChange::Removed(WorkerId::new("late").unwrap());
        assert_eq!(next(&mut watch).await, Some(gone));
    }
}
