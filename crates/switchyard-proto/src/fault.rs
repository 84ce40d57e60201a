//! Whose fault a failed call is, carried next to the status code.
//!
//! A decode worker that cannot get a request's KV from the prefill worker fails the request's
//! `Generate`, but the decode worker is fine: the prefill worker (dead, hung, its handle gone)
//! is to blame, and a retry with another prefill worker on the same decode worker can help. The
//! status code alone cannot say that (`UNAVAILABLE` is also what a draining decode worker
//! answers), and the message is for people. So the worker marks such a status with the
//! `x-switchyard-fault: kv-source` metadata entry ([`kv_source_unavailable`]) and the gateway
//! reads the mark ([`fault_of`]); both ends share this module so they cannot drift apart.

use tonic::Status;

/// The metadata key (trailers of a failed call) naming the party at fault.
pub const FAULT_KEY: &str = "x-switchyard-fault";

/// Who a marked failure is attributed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The KV source of a disaggregated request: the prefill worker (or its engine) that was to
    /// provide the prompt's KV. The worker that answered is not at fault; retrying it with
    /// another prefill worker can help.
    KvSource,
    /// The KV source's layout describes another model shape than the answering worker's (a
    /// deployment error: the two were never meant to pair). Neither worker is faulty and no
    /// retry of the same pairing can help, so the request is refused rather than retried.
    KvLayout,
}

impl Fault {
    /// The metadata value naming this fault.
    pub const fn as_str(self) -> &'static str {
        match self {
            Fault::KvSource => "kv-source",
            Fault::KvLayout => "kv-layout",
        }
    }

    fn parse(value: &str) -> Option<Fault> {
        match value {
            "kv-source" => Some(Fault::KvSource),
            "kv-layout" => Some(Fault::KvLayout),
            _ => None,
        }
    }
}

/// `UNAVAILABLE` with `message`, marked as the KV source's fault
/// ([`ErrorCode::KvSource`](crate::ErrorCode::KvSource)).
pub fn kv_source_unavailable(message: impl Into<String>) -> Status {
    crate::ErrorCode::KvSource.status(message)
}

/// `INVALID_ARGUMENT` with `message`, marked as a KV layout mismatch between the two workers
/// ([`ErrorCode::KvLayout`](crate::ErrorCode::KvLayout)).
pub fn kv_layout_mismatch(message: impl Into<String>) -> Status {
    crate::ErrorCode::KvLayout.status(message)
}

/// The fault `status` is marked with, if any. Unknown values (a newer worker's) are no mark:
/// the failure then stays the answering worker's, as it was before marks existed.
pub fn fault_of(status: &Status) -> Option<Fault> {
    status
        .metadata()
        .get(FAULT_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(Fault::parse)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use tonic::Code;
    use tonic::metadata::MetadataValue;

    use super::*;

    #[test]
    fn the_mark_is_read_back_and_unmarked_statuses_have_none() {
        let marked = kv_source_unavailable("anything at all");
        assert_eq!(marked.code(), Code::Unavailable);
        assert_eq!(marked.message(), "anything at all");
        assert_eq!(fault_of(&marked), Some(Fault::KvSource));
        assert_eq!(
            fault_of(&Status::unavailable("pulling kv from x: gone")),
            None
        );
        let mut unknown = Status::unavailable("m");
        unknown
            .metadata_mut()
            .insert(FAULT_KEY, MetadataValue::from_static("someone-else"));
        assert_eq!(fault_of(&unknown), None);
        let layout = kv_layout_mismatch("32 layers here, 40 there");
        assert_eq!(layout.code(), Code::InvalidArgument);
        assert_eq!(fault_of(&layout), Some(Fault::KvLayout));
    }
}
