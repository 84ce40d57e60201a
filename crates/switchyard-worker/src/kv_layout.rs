//! KV layout negotiation between the two sides of a pull.
//!
//! The prefill worker announces its layout on the first chunk of `PullKv` ([`announce`]); the
//! decode worker checks it against its own and plans the copy from it ([`accept`]). Only the
//! tensor-parallel split may differ between the sides: it decides how each block is cut into
//! copy descriptors. Any other difference (layers, KV heads, head size, element size, block
//! size) means the KV was computed for another model shape and would be garbage here, which is
//! a deployment error: refused as `INVALID_ARGUMENT`, marked so the gateway neither blames the
//! client nor retries the pairing. A source that announces nothing (a worker from before the
//! announcement) is planned from `[kv_transfer] prefill_tensor_parallel`, as before.

use switchyard_engine_sim::KvLayout;
use switchyard_proto::ErrorCode;
use switchyard_proto::v1;
use tonic::Status;

/// What this worker announces to the workers that pull from it.
pub(crate) fn announce(layout: &KvLayout, block_size: u32) -> v1::KvLayout {
    v1::KvLayout {
        layers: layout.layers,
        kv_heads: layout.kv_heads,
        head_dim: layout.head_dim,
        dtype_bytes: layout.dtype_bytes,
        block_size,
        tensor_parallel: layout.tensor_parallel,
    }
}

/// The source layout to plan a pull from `address` with, given what it announced, or the
/// refusal naming both sides when it cannot be this worker's model.
pub(crate) fn accept(
    announced: &v1::KvLayout,
    own: &KvLayout,
    own_block_size: u32,
    address: &str,
) -> Result<KvLayout, Status> {
    let source = KvLayout {
        layers: announced.layers,
        kv_heads: announced.kv_heads,
        head_dim: announced.head_dim,
        dtype_bytes: announced.dtype_bytes,
        tensor_parallel: announced.tensor_parallel,
    };
    if !source.same_model(own) || announced.block_size != own_block_size {
        return Err(ErrorCode::KvLayout.status(format!(
            "the prefill worker {address} holds KV for {} but this decode worker holds {}: the \
             KV cannot be used here (pair workers of one model shape; only tensor_parallel may differ)",
            describe(&source, announced.block_size),
            describe(own, own_block_size),
        )));
    }
    // Same shape, so only the split can be wrong (0, or not dividing the heads).
    source.validate().map_err(|e| {
        ErrorCode::KvLayout.status(format!(
            "the prefill worker {address} announces an impossible kv layout: {e}"
        ))
    })?;
    Ok(source)
}

fn describe(layout: &KvLayout, block_size: u32) -> String {
    format!(
        "{} layers x {} kv heads x {} dims at {} bytes per element in blocks of {} tokens (tensor_parallel {})",
        layout.layers,
        layout.kv_heads,
        layout.head_dim,
        layout.dtype_bytes,
        block_size,
        layout.tensor_parallel
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use switchyard_proto::fault::{Fault, fault_of};

    use super::*;

    fn own() -> KvLayout {
        KvLayout {
            tensor_parallel: 2,
            ..KvLayout::default()
        }
    }

    #[test]
    fn another_split_is_accepted_and_planned_from() {
        let prefill = KvLayout::default();
        let source = accept(&announce(&prefill, 16), &own(), 16, "p:1").unwrap();
        assert_eq!(source, prefill);
    }

    #[test]
    fn another_model_shape_or_block_size_is_refused_naming_both_sides() {
        let deeper = KvLayout {
            layers: 40,
            ..KvLayout::default()
        };
        let status = accept(&announce(&deeper, 16), &own(), 16, "p:1").unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(fault_of(&status), Some(Fault::KvLayout));
        let message = status.message();
        assert!(message.contains("p:1 holds KV for 40 layers"), "{message}");
        assert!(
            message.contains("this decode worker holds 32 layers"),
            "{message}"
        );
        let fp8 = KvLayout {
            dtype_bytes: 1,
            ..KvLayout::default()
        };
        assert!(accept(&announce(&fp8, 16), &own(), 16, "p:1").is_err());
        let status = accept(&announce(&KvLayout::default(), 32), &own(), 16, "p:1").unwrap_err();
        assert!(
            status.message().contains("blocks of 32 tokens"),
            "{}",
            status.message()
        );
    }

    #[test]
    fn an_impossible_split_is_refused() {
        let odd = KvLayout {
            tensor_parallel: 3,
            ..KvLayout::default()
        };
        let status = accept(&announce(&odd, 16), &own(), 16, "p:1").unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status.message().contains("impossible"),
            "{}",
            status.message()
        );
    }
}
