//! Switchyard's gRPC protocol.
//!
//! [`v1`] is the code tonic/prost generate from `proto/switchyard/v1/worker.proto`;
//! [`convert`] maps its messages to and from `switchyard-core` types, refusing messages that
//! would break a core invariant (an invalid worker id, a zero block size, a missing oneof);
//! [`fault`] is the status mark that says a failure is the KV source's, not the answering
//! worker's. `v1::StoredBlock` and `v1::GenerateRequest` are written by hand (`stored_block.rs`,
//! `generate_request.rs`): the token ids a gateway decodes most and those it encodes with every
//! request, which prost's generated code decodes growing their vector and encodes a byte at a
//! time.

pub mod convert;
pub mod error_code;
pub mod fault;
mod generate_request;
mod stored_block;
mod token_ids;

/// Generated protocol types, package `switchyard.v1`.
#[allow(
    clippy::all,
    clippy::pedantic,
    missing_debug_implementations,
    unreachable_pub
)]
pub mod v1 {
    tonic::include_proto!("switchyard.v1");
    pub use crate::generate_request::GenerateRequest;
    pub use crate::stored_block::StoredBlock;
}

pub use convert::{
    ProtoError, identity_from_proto, identity_to_proto, retention_from_proto, retention_to_proto,
};
pub use error_code::ErrorCode;
