//! Waiting for the registry's backend: a role started while etcd is down (or a call that meets
//! an outage) waits and retries with backoff instead of exiting, and says so in its log.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::{Fault, RegistryError};

/// First wait after a failed attempt; doubles up to [`MAX_BACKOFF`].
pub const MIN_BACKOFF: Duration = Duration::from_millis(200);
/// Longest wait between two attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Runs `attempt` until it succeeds, retrying while its error is the backend's fault (etcd
/// unreachable, slow, or a lease that is being replaced) with backoff from [`MIN_BACKOFF`] to
/// [`MAX_BACKOFF`], and logging each wait with `what` (for example "connect to etcd"). Errors
/// that are the caller's or the data's fault return at once: waiting cannot fix them.
///
/// `Ok(None)` when `cancel` fires first (a shutdown while waiting).
pub async fn until_available<T, F, Fut>(
    what: &str,
    cancel: &CancellationToken,
    mut attempt: F,
) -> Result<Option<T>, RegistryError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, RegistryError>>,
{
    let mut backoff = MIN_BACKOFF;
    let mut failures = 0u32;
    loop {
        let outcome = tokio::select! {
            () = cancel.cancelled() => return Ok(None),
            outcome = attempt() => outcome,
        };
        match outcome {
            Ok(value) => {
                if failures > 0 {
                    tracing::info!(failures, "{what}: the registry answers again");
                }
                return Ok(Some(value));
            }
            Err(error) if error.fault() == Fault::Backend => {
                failures += 1;
                tracing::warn!(%error, attempt = failures, retry_in = ?backoff, "{what}: the registry is unavailable; waiting for it");
            }
            Err(error) => return Err(error),
        }
        tokio::select! {
            () = cancel.cancelled() => return Ok(None),
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use switchyard_core::WorkerId;

    use super::*;

    fn outage() -> RegistryError {
        RegistryError::Timeout {
            action: "reach etcd",
            after: Duration::from_secs(1),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn waits_through_outages_with_growing_backoff() {
        let calls = Arc::new(AtomicU32::new(0));
        let started = tokio::time::Instant::now();
        let counted = Arc::clone(&calls);
        let value = until_available("connect", &CancellationToken::new(), || {
            let counted = Arc::clone(&counted);
            async move {
                if counted.fetch_add(1, Ordering::SeqCst) < 6 {
                    Err(outage())
                } else {
                    Ok(7)
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(value, Some(7));
        assert_eq!(calls.load(Ordering::SeqCst), 7);
        // 0.2 + 0.4 + 0.8 + 1.6 + 3.2 + 5 (capped) seconds of virtual time.
        assert_eq!(started.elapsed(), Duration::from_millis(11_200));
    }

    #[tokio::test(start_paused = true)]
    async fn the_callers_faults_return_at_once() {
        let calls = AtomicU32::new(0);
        let err = until_available("register", &CancellationToken::new(), || {
            calls.fetch_add(1, Ordering::SeqCst);
            async {
                Err::<(), _>(RegistryError::AlreadyRegistered(
                    WorkerId::new("w").unwrap(),
                ))
            }
        })
        .await
        .unwrap_err();
        assert!(matches!(err, RegistryError::AlreadyRegistered(_)));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_shutdown_ends_the_wait() {
        let cancel = CancellationToken::new();
        let trigger = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            trigger.cancel();
        });
        let outcome = until_available("connect", &cancel, || async { Err::<(), _>(outage()) })
            .await
            .unwrap();
        assert_eq!(outcome, None);
    }
}
