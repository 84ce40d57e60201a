//! What a worker's failed `Generate` means for the request: the gRPC status read with the
//! protocol's one error-code type ([`ErrorCode`]: code, fault mark, retryability) and turned
//! into the serving machine's [`AttemptEnd`]. The message is for people and is only passed on.

use switchyard_proto::ErrorCode;
use switchyard_router::serve::{AttemptEnd, Blame, ServeError};

/// The attempt's end for a failed call's `status`.
pub fn classify(status: tonic::Status) -> AttemptEnd {
    let code = ErrorCode::of(&status);
    if !code.retryable() {
        // The request itself is wrong (400), or the decode worker cannot use the prefill
        // worker's KV (another model shape: the deployment pairs workers that must not pair;
        // not the client's fault, so 502, and no retry that would hide it).
        let message = status.message().to_owned();
        return AttemptEnd::Refused(if code.http() == 400 {
            ServeError::BadRequest(message)
        } else {
            ServeError::Upstream(message)
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

    use super::*;

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
            AttemptEnd::Refused(ServeError::BadRequest(_))
        ));
        // A layout mismatch is refused too, but as the deployment's error, not the client's.
        match classify(switchyard_proto::fault::kv_layout_mismatch(
            "prefill p:1 announces 40 layers; this decode worker has 32",
        )) {
            AttemptEnd::Refused(ServeError::Upstream(message)) => {
                assert!(message.contains("40 layers"), "{message}");
            }
            _ => panic!("a layout mismatch is refused as an upstream error"),
        }
    }
}
