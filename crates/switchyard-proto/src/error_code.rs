//! The one error-code type of the worker protocol: what a failed worker call means, with its
//! gRPC code, the HTTP status the gateway answers a client with when the failure is final, and
//! whether another attempt (another worker, another prefill worker) can help.
//!
//! The worker builds its failed statuses from it ([`ErrorCode::status`]), the gateway reads
//! them back with [`ErrorCode::of`]; both ends share this type so code, mark and meaning
//! cannot drift apart. Faults attributed to a third party carry their mark
//! ([`crate::fault`]).

use tonic::{Code, Status};

use crate::fault::{FAULT_KEY, Fault, fault_of};

/// What a failed worker call means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// The request itself is wrong (empty prompt, too long for the context, a missing field):
    /// `INVALID_ARGUMENT` (or `OUT_OF_RANGE` read back), 400, no retry.
    InvalidRequest,
    /// This worker cannot take the request in its current role or pairing (a decode worker
    /// asked to prefill, an engine pairing it cannot serve): `FAILED_PRECONDITION`, 503; another
    /// worker can.
    WrongWorker,
    /// The worker (or its engine) cannot serve now: draining, stopped, unreachable:
    /// `UNAVAILABLE`, 503; another worker or a later retry can help.
    Unavailable,
    /// A disaggregated request's KV could not be had from its source (the prefill worker):
    /// `UNAVAILABLE` marked [`Fault::KvSource`], 502; another prefill worker can help.
    KvSource,
    /// The KV source's layout is another model shape's: `INVALID_ARGUMENT` marked
    /// [`Fault::KvLayout`], 502; a deployment error no retry can hide.
    KvLayout,
    /// A held KV handle is unknown (expired, already pulled): `NOT_FOUND`, 404.
    NotFound,
    /// The engine cannot do what was asked: `UNIMPLEMENTED`, 501; retrying on it cannot help.
    Unsupported,
    /// The caller may not make this call: `PERMISSION_DENIED`, 403.
    PermissionDenied,
    /// Anything else the worker answered (internal errors, cancellations): its gRPC code kept,
    /// 502; another worker can help.
    Other(Code),
}

impl ErrorCode {
    /// The gRPC code the worker answers with.
    pub fn grpc(self) -> Code {
        match self {
            ErrorCode::InvalidRequest | ErrorCode::KvLayout => Code::InvalidArgument,
            ErrorCode::WrongWorker => Code::FailedPrecondition,
            ErrorCode::Unavailable | ErrorCode::KvSource => Code::Unavailable,
            ErrorCode::NotFound => Code::NotFound,
            ErrorCode::Unsupported => Code::Unimplemented,
            ErrorCode::PermissionDenied => Code::PermissionDenied,
            ErrorCode::Other(code) => code,
        }
    }

    /// The HTTP status a client gets when this failure ends its request.
    pub fn http(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest => 400,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::Unsupported => 501,
            ErrorCode::WrongWorker | ErrorCode::Unavailable => 503,
            ErrorCode::KvSource | ErrorCode::KvLayout | ErrorCode::Other(_) => 502,
        }
    }

    /// Whether another attempt can help: the request is not at fault and the failure is not a
    /// deployment error.
    pub fn retryable(self) -> bool {
        !matches!(self, ErrorCode::InvalidRequest | ErrorCode::KvLayout)
    }

    /// The status the worker answers with, marked when the fault is a third party's.
    pub fn status(self, message: impl Into<String>) -> Status {
        let mut status = Status::new(self.grpc(), message);
        let fault = match self {
            ErrorCode::KvSource => Some(Fault::KvSource),
            ErrorCode::KvLayout => Some(Fault::KvLayout),
            _ => None,
        };
        if let Some(fault) = fault {
            status.metadata_mut().insert(
                FAULT_KEY,
                tonic::metadata::MetadataValue::from_static(fault.as_str()),
            );
        }
        status
    }

    /// What a worker's failed status means: its code and fault mark read back.
    pub fn of(status: &Status) -> Self {
        match (status.code(), fault_of(status)) {
            (Code::Unavailable, Some(Fault::KvSource)) => ErrorCode::KvSource,
            (Code::InvalidArgument, Some(Fault::KvLayout)) => ErrorCode::KvLayout,
            (Code::InvalidArgument | Code::OutOfRange, _) => ErrorCode::InvalidRequest,
            (Code::FailedPrecondition, _) => ErrorCode::WrongWorker,
            (Code::Unavailable, _) => ErrorCode::Unavailable,
            (Code::NotFound, _) => ErrorCode::NotFound,
            (Code::Unimplemented, _) => ErrorCode::Unsupported,
            (Code::PermissionDenied, _) => ErrorCode::PermissionDenied,
            (code, _) => ErrorCode::Other(code),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn every_code_reads_back_as_itself_with_its_http_status_and_retryability() {
        let all = [
            ErrorCode::InvalidRequest,
            ErrorCode::WrongWorker,
            ErrorCode::Unavailable,
            ErrorCode::KvSource,
            ErrorCode::KvLayout,
            ErrorCode::NotFound,
            ErrorCode::Unsupported,
            ErrorCode::PermissionDenied,
            ErrorCode::Other(Code::Internal),
        ];
        for code in all {
            let status = code.status("m");
            assert_eq!(status.code(), code.grpc());
            assert_eq!(status.message(), "m");
            assert_eq!(ErrorCode::of(&status), code, "{code:?}");
        }
        assert_eq!(
            fault_of(&ErrorCode::KvSource.status("x")),
            Some(Fault::KvSource)
        );
        assert_eq!(fault_of(&ErrorCode::Unavailable.status("x")), None);
        assert_eq!(
            ErrorCode::of(&Status::out_of_range("x")),
            ErrorCode::InvalidRequest
        );
        assert_eq!(ErrorCode::InvalidRequest.http(), 400);
        assert_eq!(ErrorCode::KvLayout.http(), 502);
        assert!(!ErrorCode::InvalidRequest.retryable());
        assert!(!ErrorCode::KvLayout.retryable());
        assert!(ErrorCode::KvSource.retryable());
        assert!(ErrorCode::Other(Code::Internal).retryable());
    }
}
