//! `switchyard.v1.StoredBlock`, written by hand instead of generated (`build.rs` maps the proto
//! message here), so that decoding its token ids costs one exact allocation per block.
//!
//! prost's generated decoder pushes a packed field's values one at a time into an empty vector,
//! which grows 0 → 4 → 8 → 16 for a 16-token block: three allocations per block, 48 for each
//! 16-block `Stored` event a gateway ingests (`benches/ingest.rs`). Here (`token_ids.rs`) the
//! packed values are counted first (one varint ends at each byte below 0x80) and the vector
//! reserved once. The
//! wire form is the proto's exactly: the same fields, encoded as prost encodes them, and an
//! unpacked or split field decoded by prost's own code.

use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType, skip_field, uint64};

use crate::token_ids::{encode_packed_u32, encoded_len_packed_u32, merge_token_ids};

/// One newly cached full block: its chained hash and its tokens.
#[derive(Clone, PartialEq, Eq, Hash, Default, Debug)]
pub struct StoredBlock {
    pub hash: u64,
    pub token_ids: Vec<u32>,
}

impl prost::Message for StoredBlock {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if self.hash != 0 {
            uint64::encode(1, &self.hash, buf);
        }
        encode_packed_u32(2, &self.token_ids, buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => uint64::merge(wire_type, &mut self.hash, buf, ctx),
            2 => merge_token_ids(wire_type, &mut self.token_ids, buf, ctx),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let hash = if self.hash != 0 {
            uint64::encoded_len(1, &self.hash)
        } else {
            0
        };
        hash + encoded_len_packed_u32(2, &self.token_ids)
    }

    fn clear(&mut self) {
        self.hash = 0;
        self.token_ids.clear();
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    /// The generated form of the message, as prost derives it, to compare wire bytes with.
    #[derive(Clone, PartialEq, ::prost::Message)]
    struct Derived {
        #[prost(uint64, tag = "1")]
        hash: u64,
        #[prost(uint32, repeated, tag = "2")]
        token_ids: Vec<u32>,
    }

    /// The same field, unpacked (one key per value), as an older or another encoder may send.
    #[derive(Clone, PartialEq, ::prost::Message)]
    struct Unpacked {
        #[prost(uint64, tag = "1")]
        hash: u64,
        #[prost(uint32, repeated, packed = "false", tag = "2")]
        token_ids: Vec<u32>,
    }

    fn samples() -> Vec<(u64, Vec<u32>)> {
        vec![
            (0, vec![]),
            (7, vec![0]),
            (
                u64::MAX,
                vec![1, 127, 128, 16_383, 16_384, 99_999, u32::MAX],
            ),
            (42, (0..16).map(|i| i * 9_973).collect()),
        ]
    }

    #[test]
    fn encodes_and_decodes_as_the_generated_message_does() {
        for (hash, token_ids) in samples() {
            let ours = StoredBlock {
                hash,
                token_ids: token_ids.clone(),
            };
            let derived = Derived { hash, token_ids };
            let bytes = derived.encode_to_vec();
            assert_eq!(ours.encode_to_vec(), bytes);
            assert_eq!(ours.encoded_len(), derived.encoded_len());
            assert_eq!(StoredBlock::decode(bytes.as_slice()).unwrap(), ours);
        }
    }

    #[test]
    fn decodes_unpacked_split_and_repeated_fields() {
        for (hash, token_ids) in samples() {
            let unpacked = Unpacked {
                hash,
                token_ids: token_ids.clone(),
            }
            .encode_to_vec();
            let want = StoredBlock {
                hash,
                token_ids: token_ids.clone(),
            };
            assert_eq!(StoredBlock::decode(unpacked.as_slice()).unwrap(), want);
            // Split across two chunks at every point: prost's own path where the chunk ends early.
            let packed = want.encode_to_vec();
            for at in 0..=packed.len() {
                let (a, b) = packed.split_at(at);
                assert_eq!(
                    StoredBlock::decode(a.chain(b)).unwrap(),
                    want,
                    "split at {at}"
                );
            }
            // A repeated field is appended to, as prost does.
            let twice = [packed.clone(), packed].concat();
            let mut doubled = token_ids.clone();
            doubled.extend(&token_ids);
            assert_eq!(
                StoredBlock::decode(twice.as_slice()).unwrap().token_ids,
                doubled
            );
        }
    }

    #[test]
    fn reads_long_varints_as_prost_does() {
        // Packed values of 5 and 10 bytes (past 32 bits: truncated), between short ones.
        let mut field = vec![0x05];
        prost::encoding::encode_varint((1 << 32) | 5, &mut field);
        prost::encoding::encode_varint(u64::MAX, &mut field);
        field.push(0x7f);
        let mut bytes = vec![0x12, field.len() as u8];
        bytes.extend(&field);
        let derived = Derived::decode(bytes.as_slice()).unwrap();
        assert_eq!(derived.token_ids, vec![5, 5, u32::MAX, 127]);
        assert_eq!(
            StoredBlock::decode(bytes.as_slice()).unwrap().token_ids,
            derived.token_ids
        );
    }

    #[test]
    fn refuses_what_prost_refuses() {
        // A packed length past the end, a varint cut at the field's end, an over-long varint.
        for bytes in [
            &[0x12, 0x05, 0x01][..],
            &[0x12, 0x02, 0x01, 0x80],
            &[
                0x12, 0x0b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
            ],
        ] {
            assert!(StoredBlock::decode(bytes).is_err(), "{bytes:?}");
            assert!(Derived::decode(bytes).is_err(), "{bytes:?}");
        }
    }
}
