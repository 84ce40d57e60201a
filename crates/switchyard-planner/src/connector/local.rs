//! The local connector: moves running workers between the pools with gRPC `Control`.
//!
//! A move never loses a request: the worker is drained first (it refuses new work, which the
//! gateway retries elsewhere, and the requests it runs finish: a decode worker completes its
//! sequences, a prefill worker its prefills; KV it holds for a decode worker stays pullable,
//! because `PullKv` does not depend on the role). Only when nothing is in flight does it get
//! its new role; the connector waits until the registry shows that role (so gateways route by
//! it) and then resumes the worker. A worker that does not go idle within the drain timeout is
//! resumed in its old role and the move is reported as failed (retryable).
//!
//! The desired role of every pool worker is recorded in the registry (`roles/<id>`).
//! Workers with role `both` are not in either pool and are left alone.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use switchyard_core::{Role, WorkerId, WorkerInfo};
use switchyard_proto::v1::{self, ControlRequest, control_request::Command};
use switchyard_registry::Registry;
use tokio::time::Instant;

use super::{Connector, ConnectorError, PoolSizes};
use crate::observe::{WorkerBoard, open_dialer, worker_endpoint};
use switchyard_security::Dialer;

/// Longest single `Drain` wait; longer drains poll again so a stuck call shows in the logs.
const DRAIN_POLL: Duration = Duration::from_secs(5);
/// How long a new role may take to appear in the registry.
const ROLE_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// Gateways learn the role through their own registry watch, a moment after it is stored;
/// the worker stays drained that much longer so no request is routed by the old role (one
/// would be retried elsewhere, but a retry costs latency).
const ROLE_SETTLE: Duration = Duration::from_millis(250);

#[derive(Debug)]
pub struct LocalConnector {
    registry: Arc<dyn Registry>,
    board: WorkerBoard,
    drain_timeout: Duration,
    dialer: Dialer,
}

impl LocalConnector {
    /// `board` is the observer's latest view of the workers' load (the least busy move first).
    pub fn new(registry: Arc<dyn Registry>, board: WorkerBoard, drain_timeout: Duration) -> Self {
        Self {
            registry,
            board,
            drain_timeout,
            dialer: open_dialer(),
        }
    }

    /// The same connector, dialing workers with `dialer` (the planner's credential).
    pub fn with_dialer(mut self, dialer: Dialer) -> Self {
        self.dialer = dialer;
        self
    }

    async fn pool_workers(&self) -> Result<Vec<WorkerInfo>, ConnectorError> {
        let workers = self
            .registry
            .list_workers()
            .await
            .map_err(|e| ConnectorError::Failed {
                what: format!("cannot list workers: {e}"),
                retryable: true,
            })?;
        Ok(workers
            .into_iter()
            .filter(|w| w.role != Role::Both)
            .collect())
    }

    /// Running requests as last reported; unknown counts as busy so it moves last.
    fn busyness(&self, id: &WorkerId) -> u64 {
        let board = self.board.lock().unwrap_or_else(|p| p.into_inner());
        board
            .get(id)
            .and_then(|w| w.load.as_ref())
            .map_or(u64::MAX, |l| l.running_requests + l.waiting_requests)
    }

    /// Drains `worker`, gives it `role`, waits for the registry to show it, resumes it.
    async fn move_worker(&self, worker: &WorkerInfo, role: Role) -> Result<(), ConnectorError> {
        let failed = |what: String| ConnectorError::Failed {
            what: format!("moving {} to {role}: {what}", worker.id),
            retryable: true,
        };
        let endpoint = worker_endpoint(&self.dialer, &worker.address)
            .ok_or_else(|| failed(format!("bad address {}", worker.address)))?;
        let channel = self
            .dialer
            .connect(endpoint)
            .await
            .map_err(|e| failed(format!("cannot connect: {e}")))?;
        let mut client = v1::worker_client::WorkerClient::new(channel);
        let mut control = async |command: Command| {
            client
                .control(ControlRequest {
                    command: Some(command),
                })
                .await
                .map(tonic::Response::into_inner)
        };
        tracing::info!(worker = %worker.id, from = %worker.role, to = %role, "draining before the move");
        let deadline = Instant::now() + self.drain_timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let wait = left.min(DRAIN_POLL);
            let answer = control(Command::Drain(v1::Drain {
                wait_ms: u32::try_from(wait.as_millis()).unwrap_or(u32::MAX),
            }))
            .await
            .map_err(|s| failed(format!("drain refused: {}", s.message())))?;
            if answer.in_flight == 0 {
                break;
            }
            if left.is_zero() {
                // Give the worker back to its pool rather than leave it refusing work.
                let _ = control(Command::Resume(v1::Resume {})).await;
                return Err(failed(format!(
                    "{} requests still running after {:.0} s of draining",
                    answer.in_flight,
                    self.drain_timeout.as_secs_f64()
                )));
            }
        }
        let set = control(Command::SetRole(v1::SetRole {
            role: v1::Role::from(role).into(),
        }))
        .await;
        if let Err(status) = set {
            let _ = control(Command::Resume(v1::Resume {})).await;
            return Err(failed(format!("set_role refused: {}", status.message())));
        }
        self.wait_for_published_role(&worker.id, role).await;
        control(Command::Resume(v1::Resume {}))
            .await
            .map_err(|s| failed(format!("resume refused: {}", s.message())))?;
        tracing::info!(worker = %worker.id, role = %role, "worker moved");
        Ok(())
    }

    /// Waits (bounded) until the worker's registry entry carries `role`, so that gateways
    /// route by the new role before the worker takes requests again.
    async fn wait_for_published_role(&self, id: &WorkerId, role: Role) {
        let deadline = Instant::now() + ROLE_PUBLISH_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(workers) = self.registry.list_workers().await
                && workers.iter().any(|w| &w.id == id && w.role == role)
            {
                tokio::time::sleep(ROLE_SETTLE).await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::warn!(worker = %id, role = %role, "new role not in the registry yet; resuming anyway");
    }
}

/// Which workers change role to reach `target` from `workers` (moves only; the total stays).
fn plan_moves(
    workers: &[WorkerInfo],
    target: PoolSizes,
    busyness: impl Fn(&WorkerId) -> u64,
) -> Vec<(WorkerInfo, Role)> {
    let prefill = workers.iter().filter(|w| w.role == Role::Prefill).count() as u32;
    let (from, to, count) = if target.prefill > prefill {
        (Role::Decode, Role::Prefill, target.prefill - prefill)
    } else {
        (Role::Prefill, Role::Decode, prefill - target.prefill)
    };
    let mut candidates: Vec<&WorkerInfo> = workers.iter().filter(|w| w.role == from).collect();
    // Least busy first; ties by id so the choice is reproducible.
    candidates.sort_by(|a, b| busyness(&a.id).cmp(&busyness(&b.id)).then(a.id.cmp(&b.id)));
    candidates
        .into_iter()
        .take(count as usize)
        .map(|w| (w.clone(), to))
        .collect()
}

#[async_trait]
impl Connector for LocalConnector {
    fn name(&self) -> &'static str {
        "local"
    }

    async fn current(&self) -> Result<PoolSizes, ConnectorError> {
        let workers = self.pool_workers().await?;
        Ok(PoolSizes {
            prefill: workers.iter().filter(|w| w.role == Role::Prefill).count() as u32,
            decode: workers.iter().filter(|w| w.role == Role::Decode).count() as u32,
        })
    }

    async fn capacity(&self) -> Result<Option<u32>, ConnectorError> {
        Ok(Some(self.pool_workers().await?.len() as u32))
    }

    async fn scale_to(&self, target: PoolSizes) -> Result<(), ConnectorError> {
        let workers = self.pool_workers().await?;
        if target.total() != workers.len() as u32 {
            // The planner sizes for `capacity()`; a mismatch means workers came or went since,
            // and the next interval plans for the new set.
            return Err(ConnectorError::Failed {
                what: format!(
                    "the local connector moves the {} running pool workers between pools; it cannot make {} prefill + {} decode",
                    workers.len(),
                    target.prefill,
                    target.decode
                ),
                retryable: true,
            });
        }
        let moves = plan_moves(&workers, target, |id| self.busyness(id));
        // Moves run together: each worker drains on its own schedule, and the pool it leaves
        // keeps its other workers serving meanwhile.
        let results = futures::future::join_all(
            moves
                .iter()
                .map(|(worker, role)| self.move_worker(worker, *role)),
        )
        .await;
        let moved: Vec<&WorkerInfo> = moves
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|((w, _), _)| w)
            .collect();
        for worker in &workers {
            let role = moves
                .iter()
                .find(|(w, _)| w.id == worker.id && moved.iter().any(|m| m.id == w.id))
                .map_or(worker.role, |(_, role)| *role);
            if let Err(err) = self.registry.set_desired_role(&worker.id, role).await {
                tracing::warn!(worker = %worker.id, error = %err, "cannot record the desired role");
            }
        }
        let errors: Vec<String> = results
            .into_iter()
            .filter_map(|r| r.err().map(|e| e.to_string()))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConnectorError::Failed {
                what: errors.join("; "),
                retryable: true,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use switchyard_core::{BlockSize, EngineKind};

    fn worker(id: &str, role: Role) -> WorkerInfo {
        WorkerInfo {
            adapters: Vec::new(),
            id: WorkerId::new(id).unwrap(),
            address: "127.0.0.1:1".into(),
            model: "m".into(),
            role,
            block_size: BlockSize::new(16).unwrap(),
            kv_capacity_blocks: 1,
            max_context_tokens: 1024,
            engine: EngineKind::default(),
            incarnation: 0,
            engine_endpoint: None,
            kv_tiers: None,
            kv_peer: None,
        }
    }

    #[test]
    fn moves_take_the_least_busy_workers_of_the_shrinking_pool() {
        let workers = vec![
            worker("a", Role::Decode),
            worker("b", Role::Decode),
            worker("c", Role::Decode),
            worker("d", Role::Prefill),
        ];
        let busy = |id: &WorkerId| match id.as_str() {
            "a" => 9,
            "b" => 1,
            _ => 5,
        };
        let moves = plan_moves(
            &workers,
            PoolSizes {
                prefill: 3,
                decode: 1,
            },
            busy,
        );
        let ids: Vec<_> = moves.iter().map(|(w, r)| (w.id.as_str(), *r)).collect();
        assert_eq!(ids, vec![("b", Role::Prefill), ("c", Role::Prefill)]);
        let back = plan_moves(
            &workers,
            PoolSizes {
                prefill: 0,
                decode: 4,
            },
            busy,
        );
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].1, Role::Decode);
        assert!(
            plan_moves(
                &workers,
                PoolSizes {
                    prefill: 1,
                    decode: 3
                },
                busy
            )
            .is_empty()
        );
    }
}
