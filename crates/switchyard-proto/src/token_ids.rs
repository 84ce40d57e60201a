//! A packed `repeated uint32` field of token ids, as Switchyard's hand-written messages
//! (`stored_block.rs`, `generate_request.rs`) encode and decode it: the wire form prost gives,
//! without its costs. prost's generated code writes a packed field's varints a byte at a time
//! into the buffer (a capacity check per byte) and measures them the same way; its decoder
//! pushes the values one at a time into an empty vector (three allocations for a 16-token
//! block). Here the values are measured with a few bit operations each and written through a
//! stack buffer, and a field lying whole in the buffer is counted, reserved for once and
//! decoded in place.

use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, decode_varint, encode_key, encode_varint, encoded_len_varint, key_len,
    uint32,
};

/// Bytes of `v` as a varint: 1 to 5.
fn varint_len(v: u32) -> usize {
    (32 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// The packed varints' bytes, without key or length.
fn packed_body_len(values: &[u32]) -> usize {
    values.iter().map(|&v| varint_len(v)).sum()
}

/// What prost's `uint32::encoded_len_packed` gives (0 for no values).
pub(crate) fn encoded_len_packed_u32(tag: u32, values: &[u32]) -> usize {
    if values.is_empty() {
        return 0;
    }
    let body = packed_body_len(values);
    key_len(tag) + encoded_len_varint(body as u64) + body
}

/// What prost's `uint32::encode_packed` writes (nothing for no values), through a stack buffer.
pub(crate) fn encode_packed_u32(tag: u32, values: &[u32], buf: &mut impl BufMut) {
    if values.is_empty() {
        return;
    }
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(packed_body_len(values) as u64, buf);
    let mut chunk = [0u8; 512];
    let mut n = 0;
    for &value in values {
        if n + 5 > chunk.len() {
            buf.put_slice(&chunk[..n]);
            n = 0;
        }
        let mut v = value;
        while v >= 0x80 {
            chunk[n] = (v as u8) | 0x80;
            v >>= 7;
            n += 1;
        }
        chunk[n] = v as u8;
        n += 1;
    }
    buf.put_slice(&chunk[..n]);
}

/// Appends a `token_ids` field's values to `values`: a packed field lying whole in the buffer's
/// current chunk (what tonic and a byte slice give) is counted, reserved for and decoded in
/// place; anything else (unpacked values, a field split across chunks, a malformed length) goes
/// to prost's own decoder, which also gives the errors.
pub(crate) fn merge_token_ids(
    wire_type: WireType,
    values: &mut Vec<u32>,
    buf: &mut impl Buf,
    ctx: DecodeContext,
) -> Result<(), DecodeError> {
    if wire_type == WireType::LengthDelimited {
        let chunk = buf.chunk();
        let mut rest = chunk;
        if let Ok(len) = decode_varint(&mut rest) {
            let header = chunk.len() - rest.len();
            if let Some(packed) = usize::try_from(len).ok().and_then(|l| rest.get(..l)) {
                let consumed = header + packed.len();
                values.reserve(packed.iter().filter(|&&b| b < 0x80).count());
                decode_packed(packed, values)?;
                buf.advance(consumed);
                return Ok(());
            }
        }
    }
    uint32::merge_repeated(wire_type, values, buf, ctx)
}

/// Decodes packed varints: those of up to four bytes (token ids below 2^28) inline, longer or
/// cut ones by prost, as prost reads a uint32 (a varint of up to 64 bits, truncated).
fn decode_packed(mut packed: &[u8], values: &mut Vec<u32>) -> Result<(), DecodeError> {
    while !packed.is_empty() {
        let mut value = 0u32;
        let mut len = None;
        for (k, &b) in packed.iter().take(4).enumerate() {
            value |= u32::from(b & 0x7f) << (7 * k);
            if b < 0x80 {
                len = Some(k + 1);
                break;
            }
        }
        match len {
            Some(len) => {
                values.push(value);
                packed = &packed[len..];
            }
            None => values.push(decode_varint(&mut packed)? as u32),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_lengths_are_prosts() {
        for shift in 0..32 {
            for v in [1u32 << shift, (1u32 << shift) - 1, (1u32 << shift) + 1] {
                assert_eq!(varint_len(v), encoded_len_varint(u64::from(v)), "{v}");
            }
        }
        assert_eq!(varint_len(u32::MAX), 5);
    }
}
