//! A request's life across attempts, as pure transitions: what the next attempt may use, and
//! what an attempt's end means — done, retry elsewhere, migrate mid-stream, reroute, or fail.
//! No I/O here: the driver in [`super`] runs each attempt and feeds its end back.

use switchyard_core::{Sampling, TokenId, WorkerId};
use switchyard_proto::ErrorCode;
use switchyard_router::serve::{self, ServeSettings};

use super::Finish;
use crate::error::ApiError;

/// Which attempt of a request this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptKind {
    First,
    /// Before any token: the request starts again elsewhere.
    Retry,
    /// After some tokens: the request continues elsewhere from prompt + generated.
    Migration,
}

impl AttemptKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptKind::First => "first",
            AttemptKind::Retry => "retry",
            AttemptKind::Migration => "migration",
        }
    }
}

/// How an attempt ended, when it did not finish the generation.
#[derive(Debug)]
pub enum AttemptEnd {
    /// The consumer is gone; stop quietly.
    ConsumerGone,
    /// A worker failed; another may succeed. `blame` says which one to avoid next.
    WorkerFailed {
        reason: String,
        blame: Blame,
    },
    /// The request itself is bad; no worker will take it.
    Refused(ApiError),
    Done,
}

impl AttemptEnd {
    pub fn worker_failed(reason: impl Into<String>) -> Self {
        AttemptEnd::WorkerFailed {
            reason: reason.into(),
            blame: Blame::Answering,
        }
    }
}

/// Which worker a failed attempt is held against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The worker that answered (the decode worker, or the only one when aggregated).
    Answering,
    /// The KV source: the decode worker could not get the prompt's KV from the prefill worker,
    /// so the prefill worker is excluded and the decode worker stays eligible.
    KvSource,
}

/// What the driver does after an attempt.
#[derive(Debug)]
pub enum Next {
    /// Nothing more to send (finished, or the consumer left).
    Stop,
    /// Start again on another worker (no token was generated).
    Retry {
        reason: String,
    },
    /// Continue on another worker from prompt + generated.
    Migrate {
        reason: String,
    },
    /// Every token asked for was generated before the worker failed.
    Finish(Finish),
    Fail(ApiError),
}

/// The state one request carries across its attempts.
#[derive(Debug)]
pub struct Attempts {
    /// Tokens generated so far, across attempts.
    pub generated: Vec<TokenId>,
    /// Generating workers that failed this request.
    pub excluded: Vec<WorkerId>,
    /// Prefill workers that failed this request.
    pub excluded_prefill: Vec<WorkerId>,
    /// Set when a decode worker that serves only with a prefill worker's KV could get none:
    /// from then on the request goes only to workers that serve aggregated.
    pub rerouted: Option<String>,
    /// Whether the consumer was sent `Started`.
    pub started: bool,
    attempt: u32,
    retries: u32,
    migrations: u32,
    max_retries: u32,
    max_migrations: u32,
    max_tokens: u32,
}

impl Attempts {
    pub fn new(max_tokens: u32, max_retries: u32, max_migrations: u32) -> Self {
        Self {
            generated: Vec::new(),
            excluded: Vec::new(),
            excluded_prefill: Vec::new(),
            rerouted: None,
            started: false,
            attempt: 0,
            retries: 0,
            migrations: 0,
            max_retries,
            max_migrations,
            max_tokens,
        }
    }

    /// Starts the next attempt; its number (from 1).
    pub fn begin(&mut self) -> u32 {
        self.attempt += 1;
        self.attempt
    }

    pub fn kind(&self) -> AttemptKind {
        if self.attempt <= 1 {
            AttemptKind::First
        } else if self.generated.is_empty() {
            AttemptKind::Retry
        } else {
            AttemptKind::Migration
        }
    }

    /// The attempt's input: the prompt plus what was generated so far.
    pub fn context(&self, prompt: &[TokenId]) -> Vec<TokenId> {
        let mut context = Vec::with_capacity(prompt.len() + self.generated.len());
        context.extend_from_slice(prompt);
        context.extend_from_slice(&self.generated);
        context
    }

    /// Tokens still to generate.
    pub fn remaining(&self) -> u32 {
        self.max_tokens.saturating_sub(self.generated.len() as u32)
    }

    /// The request's sampling for this attempt: a migration continues with what is left to
    /// generate, and with what is left of `min_tokens`.
    pub fn sampling(&self, request: &Sampling) -> Sampling {
        let done = self.generated.len() as u32;
        Sampling {
            max_tokens: self.remaining(),
            min_tokens: request.min_tokens.map(|m| m.saturating_sub(done)),
            ..request.clone()
        }
    }

    /// Whether this attempt can use a prefill worker at all: only a fresh start can (a
    /// migration continues from tokens the failed worker produced, and the new worker
    /// recomputes that context itself).
    pub fn may_use_prefill_pool(&self) -> bool {
        self.generated.is_empty()
    }

    /// Whether this attempt must leave out the workers that serve only with a prefill worker.
    pub fn aggregated_only(&self, settings: &ServeSettings) -> bool {
        serve::aggregated_only(
            settings,
            !self.generated.is_empty(),
            self.rerouted.is_some(),
        )
    }

    /// The attempt's decode worker serves only with a prefill worker and could get none: route
    /// again among workers that serve aggregated.
    pub fn reroute(&mut self, why: String) {
        self.rerouted = Some(why);
    }

    /// The error when routing found no worker for the attempt. `needs_prefill_registered`: a
    /// worker of the model that serves only with a prefill worker is registered.
    pub fn no_candidates(
        &self,
        model: &str,
        aggregated_only: bool,
        needs_prefill_registered: bool,
    ) -> ApiError {
        let message = if let Some(why) = &self.rerouted {
            format!(
                "{why}, and no worker that serves without a prefill worker (role both, or a vllm \
                 or sim decode worker) is available for model `{model}`"
            )
        } else if aggregated_only && self.excluded.is_empty() && needs_prefill_registered {
            format!(
                "no worker that serves without a prefill worker is available for model `{model}` \
                 ({}; its sglang decode workers serve only with one)",
                if self.generated.is_empty() {
                    "disaggregation is off"
                } else {
                    "a migration continues on one worker"
                }
            )
        } else if self.excluded.is_empty() {
            format!("no worker is available for model `{model}`")
        } else {
            format!(
                "no other worker is available for model `{model}` after {} failed",
                self.excluded.len()
            )
        };
        ApiError::Unavailable(message)
    }

    /// The attempt on `worker` (with `prefill_worker` as its KV source, if any) ended with
    /// `end`: what happens next.
    pub fn ended(
        &mut self,
        end: AttemptEnd,
        worker: &WorkerId,
        prefill_worker: Option<WorkerId>,
    ) -> Next {
        let (reason, blame) = match end {
            AttemptEnd::Done | AttemptEnd::ConsumerGone => return Next::Stop,
            AttemptEnd::Refused(err) => return Next::Fail(err),
            AttemptEnd::WorkerFailed { reason, blame } => (reason, blame),
        };
        match (blame, prefill_worker) {
            (Blame::KvSource, Some(prefill)) => self.excluded_prefill.push(prefill),
            _ => self.excluded.push(worker.clone()),
        }
        if self.generated.is_empty() {
            self.retries += 1;
            if self.retries > self.max_retries {
                return Next::Fail(ApiError::Upstream(format!(
                    "{} workers failed before the first token; last: {reason}",
                    self.retries
                )));
            }
            return Next::Retry { reason };
        }
        self.migrations += 1;
        if self.migrations > self.max_migrations {
            return Next::Fail(ApiError::Upstream(format!(
                "the stream failed {} times; last: {reason}",
                self.migrations
            )));
        }
        if self.remaining() == 0 {
            return Next::Finish(Finish::Length);
        }
        Next::Migrate { reason }
    }
}

/// What a worker's failed `Generate` means for the request, read with the protocol's one
/// error-code type ([`ErrorCode`]: code, fault mark, retryability): the message is for people
/// and is only passed on.
pub fn classify(status: tonic::Status) -> AttemptEnd {
    let code = ErrorCode::of(&status);
    if !code.retryable() {
        // The request itself is wrong (400), or the decode worker cannot use the prefill
        // worker's KV (another model shape: the deployment pairs workers that must not pair;
        // not the client's fault, so 502, and no retry that would hide it).
        let message = status.message().to_owned();
        return AttemptEnd::Refused(if code.http() == 400 {
            ApiError::bad_request(message)
        } else {
            ApiError::Upstream(message)
        });
    }
    AttemptEnd::WorkerFailed {
        reason: format!("{:?}: {}", status.code(), status.message()),
        blame: if code == ErrorCode::KvSource {
            Blame::KvSource
        } else {
            Blame::Answering
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use switchyard_proto::fault::kv_source_unavailable;
    use switchyard_router::serve::Disaggregation;

    use super::*;

    fn w(id: &str) -> WorkerId {
        WorkerId::new(id).unwrap()
    }

    fn blame(status: tonic::Status) -> Option<Blame> {
        match classify(status) {
            AttemptEnd::WorkerFailed { blame, .. } => Some(blame),
            _ => None,
        }
    }

    #[test]
    fn the_fault_mark_not_the_wording_decides_who_is_blamed() {
        assert_eq!(
            blame(kv_source_unavailable("the engine went quiet")),
            Some(Blame::KvSource)
        );
        assert_eq!(
            blame(tonic::Status::unavailable(
                "pulling kv from 10.0.0.1:7000: no answer within 30s"
            )),
            Some(Blame::Answering)
        );
        assert_eq!(
            blame(tonic::Status::internal("worker crashed")),
            Some(Blame::Answering)
        );
    }

    #[test]
    fn the_human_message_is_kept() {
        match classify(kv_source_unavailable("pulling kv from p:1: stream ended")) {
            AttemptEnd::WorkerFailed { reason, .. } => {
                assert_eq!(reason, "Unavailable: pulling kv from p:1: stream ended");
            }
            _ => panic!("a marked unavailable status is a failed attempt"),
        }
        assert!(matches!(
            classify(tonic::Status::invalid_argument("prompt is empty")),
            AttemptEnd::Refused(ApiError::BadRequest { .. })
        ));
        // A layout mismatch is refused too, but as the deployment's error, not the client's.
        match classify(switchyard_proto::fault::kv_layout_mismatch(
            "prefill p:1 announces 40 layers; this decode worker has 32",
        )) {
            AttemptEnd::Refused(ApiError::Upstream(message)) => {
                assert!(message.contains("40 layers"), "{message}");
            }
            _ => panic!("a layout mismatch is refused as an upstream error"),
        }
    }

    #[test]
    fn failures_before_the_first_token_retry_elsewhere_until_the_limit() {
        let mut a = Attempts::new(8, 2, 1);
        assert_eq!(a.begin(), 1);
        assert_eq!(a.kind(), AttemptKind::First);
        let next = a.ended(
            AttemptEnd::worker_failed("Unavailable: gone"),
            &w("a"),
            None,
        );
        assert!(matches!(next, Next::Retry { .. }), "{next:?}");
        assert_eq!(a.excluded, [w("a")]);
        a.begin();
        assert_eq!(a.kind(), AttemptKind::Retry);
        assert!(matches!(
            a.ended(AttemptEnd::worker_failed("x"), &w("b"), None),
            Next::Retry { .. }
        ));
        a.begin();
        match a.ended(AttemptEnd::worker_failed("Internal: last"), &w("c"), None) {
            Next::Fail(ApiError::Upstream(message)) => {
                assert_eq!(
                    message,
                    "3 workers failed before the first token; last: Internal: last"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn failures_after_tokens_migrate_with_the_context_and_stop_at_max_tokens() {
        let mut a = Attempts::new(4, 0, 2);
        a.begin();
        a.generated.extend([10, 11]);
        match a.ended(AttemptEnd::worker_failed("Unavailable: cut"), &w("a"), None) {
            Next::Migrate { reason } => assert_eq!(reason, "Unavailable: cut"),
            other => panic!("{other:?}"),
        }
        a.begin();
        assert_eq!(a.kind(), AttemptKind::Migration);
        assert_eq!(a.context(&[1, 2]), [1, 2, 10, 11]);
        assert_eq!(a.remaining(), 2);
        assert!(!a.may_use_prefill_pool());
        // A migration continues on one worker: aggregated only, even with disaggregation on.
        let auto = ServeSettings {
            disaggregation: Disaggregation::Auto,
            ..ServeSettings::default()
        };
        assert!(a.aggregated_only(&auto));
        a.generated.extend([12, 13]);
        assert!(matches!(
            a.ended(AttemptEnd::worker_failed("x"), &w("b"), None),
            Next::Finish(Finish::Length)
        ));
        let mut b = Attempts::new(100, 0, 1);
        b.begin();
        b.generated.push(1);
        b.ended(AttemptEnd::worker_failed("x"), &w("a"), None);
        b.begin();
        assert!(matches!(
            b.ended(AttemptEnd::worker_failed("y"), &w("b"), None),
            Next::Fail(ApiError::Upstream(_))
        ));
    }

    #[test]
    fn a_kv_source_fault_excludes_the_prefill_worker_and_keeps_the_decode_worker() {
        let mut a = Attempts::new(8, 3, 0);
        a.begin();
        let next = a.ended(
            classify(kv_source_unavailable("pull failed")),
            &w("decode"),
            Some(w("prefill")),
        );
        assert!(matches!(next, Next::Retry { .. }));
        assert!(a.excluded.is_empty());
        assert_eq!(a.excluded_prefill, [w("prefill")]);
        // Without a prefill worker to blame, the answering worker is.
        a.begin();
        a.ended(classify(kv_source_unavailable("?")), &w("decode"), None);
        assert_eq!(a.excluded, [w("decode")]);
    }

    #[test]
    fn done_and_a_gone_consumer_stop_and_a_refusal_fails_without_retry() {
        let mut a = Attempts::new(8, 3, 3);
        a.begin();
        assert!(matches!(
            a.ended(AttemptEnd::Done, &w("a"), None),
            Next::Stop
        ));
        assert!(matches!(
            a.ended(AttemptEnd::ConsumerGone, &w("a"), None),
            Next::Stop
        ));
        assert!(matches!(
            a.ended(
                AttemptEnd::Refused(ApiError::bad_request("too long")),
                &w("a"),
                None
            ),
            Next::Fail(ApiError::BadRequest { .. })
        ));
        assert!(a.excluded.is_empty(), "a refusal blames no worker");
    }

    #[test]
    fn a_reroute_narrows_to_aggregated_workers_and_explains_a_503() {
        let auto = ServeSettings {
            disaggregation: Disaggregation::Auto,
            ..ServeSettings::default()
        };
        let mut a = Attempts::new(8, 1, 1);
        a.begin();
        assert!(!a.aggregated_only(&auto));
        assert!(a.aggregated_only(&ServeSettings::default()));
        a.reroute("decode worker d serves only with a prefill worker".into());
        assert!(a.aggregated_only(&auto));
        let err = a.no_candidates("m", true, true).to_string();
        assert!(err.contains("decode worker d serves only"), "{err}");
        let fresh = Attempts::new(8, 1, 1);
        assert!(
            fresh
                .no_candidates("m", true, true)
                .to_string()
                .contains("disaggregation is off")
        );
        assert!(
            fresh
                .no_candidates("m", false, false)
                .to_string()
                .contains("no worker is available for model `m`")
        );
    }
}
