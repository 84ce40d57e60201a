//! `switchyard.v1.GenerateRequest`, written by hand instead of generated (`build.rs` maps the
//! proto message here), so that its prompt's token ids are encoded in one pass.
//!
//! A gateway encodes one per request, with every token of the prompt: prost's generated encoder
//! writes a packed field's varints a byte at a time into the gRPC buffer (a capacity check per
//! byte), and measuring the field's length walks the values once more that way; on ~3k-token
//! prompts that was ≈ 8 % of a gateway's CPU (`docs/BENCHMARKS.md`, "Server CPU per request").
//! Here they are written as `token_ids.rs` writes them (measured with bit operations, through a
//! stack buffer). The wire form is the proto's exactly (the same fields, as prost encodes them; a test
//! compares the bytes with the derived message's), and the worker decodes the token ids with
//! one exact allocation, as `StoredBlock`'s (`stored_block.rs`).

use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType, int32, message, skip_field, string};

use crate::token_ids::{encode_packed_u32, encoded_len_packed_u32, merge_token_ids};
use crate::v1::{KvIdentity, KvSource, RetentionHint, SamplingParams};

/// A generation request to a worker (see `proto/switchyard/v1/worker.proto`).
#[derive(Clone, PartialEq, Default, Debug)]
pub struct GenerateRequest {
    /// Caller-chosen id, unique among the caller's in-flight requests; used in logs and aborts.
    pub request_id: String,
    pub prompt_token_ids: Vec<u32>,
    pub sampling: Option<SamplingParams>,
    /// Disaggregated serving: the prompt's KV blocks were computed by a prefill worker. The
    /// decode worker pulls them from there before generating. Absent: the worker prefills itself.
    pub kv_source: Option<KvSource>,
    /// What besides its tokens names the prompt's KV (absent: the base model's plain KV).
    pub identity: Option<KvIdentity>,
    /// Keep this request's blocks cached after it ends (absent: no preference).
    pub retention: Option<RetentionHint>,
    /// Scheduling priority, vLLM's convention: a lower value is scheduled earlier, 0 is the
    /// default (docs/engines.md, "Request priority"). Absent: the engine's default.
    pub priority: Option<i32>,
}

impl prost::Message for GenerateRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if !self.request_id.is_empty() {
            string::encode(1, &self.request_id, buf);
        }
        encode_packed_u32(2, &self.prompt_token_ids, buf);
        if let Some(m) = &self.sampling {
            message::encode(3, m, buf);
        }
        if let Some(m) = &self.kv_source {
            message::encode(4, m, buf);
        }
        if let Some(m) = &self.identity {
            message::encode(5, m, buf);
        }
        if let Some(m) = &self.retention {
            message::encode(6, m, buf);
        }
        if let Some(p) = &self.priority {
            int32::encode(7, p, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        let named = |mut e: DecodeError, field: &'static str| {
            e.push("GenerateRequest", field);
            e
        };
        match tag {
            1 => string::merge(wire_type, &mut self.request_id, buf, ctx)
                .map_err(|e| named(e, "request_id")),
            2 => merge_token_ids(wire_type, &mut self.prompt_token_ids, buf, ctx)
                .map_err(|e| named(e, "prompt_token_ids")),
            3 => merge_message(wire_type, &mut self.sampling, buf, ctx)
                .map_err(|e| named(e, "sampling")),
            4 => merge_message(wire_type, &mut self.kv_source, buf, ctx)
                .map_err(|e| named(e, "kv_source")),
            5 => merge_message(wire_type, &mut self.identity, buf, ctx)
                .map_err(|e| named(e, "identity")),
            6 => merge_message(wire_type, &mut self.retention, buf, ctx)
                .map_err(|e| named(e, "retention")),
            7 => int32::merge(
                wire_type,
                self.priority.get_or_insert_with(Default::default),
                buf,
                ctx,
            )
            .map_err(|e| named(e, "priority")),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let id = if self.request_id.is_empty() {
            0
        } else {
            string::encoded_len(1, &self.request_id)
        };
        id + encoded_len_packed_u32(2, &self.prompt_token_ids)
            + self
                .sampling
                .as_ref()
                .map_or(0, |m| message::encoded_len(3, m))
            + self
                .kv_source
                .as_ref()
                .map_or(0, |m| message::encoded_len(4, m))
            + self
                .identity
                .as_ref()
                .map_or(0, |m| message::encoded_len(5, m))
            + self
                .retention
                .as_ref()
                .map_or(0, |m| message::encoded_len(6, m))
            + self
                .priority
                .as_ref()
                .map_or(0, |p| int32::encoded_len(7, p))
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// An optional message field, merged as prost merges it (created empty on its first part).
fn merge_message<M: prost::Message + Default>(
    wire_type: WireType,
    slot: &mut Option<M>,
    buf: &mut impl Buf,
    ctx: DecodeContext,
) -> Result<(), DecodeError> {
    message::merge(wire_type, slot.get_or_insert_with(M::default), buf, ctx)
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    /// The generated form of the message, as prost derives it, to compare wire bytes with.
    #[derive(Clone, PartialEq, ::prost::Message)]
    struct Derived {
        #[prost(string, tag = "1")]
        request_id: String,
        #[prost(uint32, repeated, tag = "2")]
        prompt_token_ids: Vec<u32>,
        #[prost(message, optional, tag = "3")]
        sampling: Option<SamplingParams>,
        #[prost(message, optional, tag = "4")]
        kv_source: Option<KvSource>,
        #[prost(message, optional, tag = "5")]
        identity: Option<KvIdentity>,
        #[prost(message, optional, tag = "6")]
        retention: Option<RetentionHint>,
        #[prost(int32, optional, tag = "7")]
        priority: Option<i32>,
    }

    fn ours(d: &Derived) -> GenerateRequest {
        GenerateRequest {
            request_id: d.request_id.clone(),
            prompt_token_ids: d.prompt_token_ids.clone(),
            sampling: d.sampling.clone(),
            kv_source: d.kv_source.clone(),
            identity: d.identity.clone(),
            retention: d.retention,
            priority: d.priority,
        }
    }

    fn samples() -> Vec<Derived> {
        let tokens: Vec<u32> = (0..3_000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        vec![
            Derived::default(),
            Derived {
                request_id: "r-1".into(),
                prompt_token_ids: vec![0, 1, 127, 128, 16_383, 16_384, 99_999, u32::MAX],
                priority: Some(-3),
                ..Derived::default()
            },
            Derived {
                request_id: "chatcmpl-3k".into(),
                // Past the stack buffer, every varint length.
                prompt_token_ids: tokens,
                sampling: Some(SamplingParams {
                    max_tokens: 8,
                    temperature: Some(0.5),
                    stop_token_ids: vec![151_645, 151_643],
                    ..SamplingParams::default()
                }),
                kv_source: Some(KvSource::default()),
                identity: Some(KvIdentity {
                    adapter: Some("lora-a".into()),
                    cache_salt: None,
                }),
                retention: Some(RetentionHint {
                    ttl_ms: 30_000,
                    priority: 2,
                }),
                priority: Some(0),
            },
        ]
    }

    #[test]
    fn encodes_and_decodes_as_the_generated_message_does() {
        for derived in samples() {
            let ours = ours(&derived);
            let bytes = derived.encode_to_vec();
            assert_eq!(ours.encode_to_vec(), bytes);
            assert_eq!(ours.encoded_len(), derived.encoded_len());
            assert_eq!(GenerateRequest::decode(bytes.as_slice()).unwrap(), ours);
            assert_eq!(Derived::decode(bytes.as_slice()).unwrap(), derived);
        }
    }

    #[test]
    fn a_malformed_field_is_refused_and_named() {
        // The token ids' packed length runs past the end.
        let err = GenerateRequest::decode(&[0x12, 0x05, 0x01][..]).unwrap_err();
        assert!(err.to_string().contains("prompt_token_ids"), "{err}");
        assert!(Derived::decode(&[0x12, 0x05, 0x01][..]).is_err());
    }
}
