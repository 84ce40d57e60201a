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

/// The packed varints' bytes, without key or length: one byte per value and one more for each
/// 7-bit boundary it passes, counted in lanes the compiler vectorizes (a `u32` count per 1,024
/// values cannot overflow).
fn packed_body_len(values: &[u32]) -> usize {
    let extra: usize = values
        .chunks(1024)
        .map(|chunk| {
            chunk
                .iter()
                .map(|&v| {
                    u32::from(v >= 1 << 7)
                        + u32::from(v >= 1 << 14)
                        + u32::from(v >= 1 << 21)
                        + u32::from(v >= 1 << 28)
                })
                .sum::<u32>() as usize
        })
        .sum();
    values.len() + extra
}

/// Writes `value` as a varint at `out[0..]` and returns its length. Below 2^28 (every token id
/// of a real vocabulary) its four 7-bit groups are spread over four bytes, continuation bits
/// set on all but the last, and stored at once: `out` must have 4 bytes (5 for larger values).
#[inline(always)]
fn put_varint(value: u32, out: &mut [u8]) -> usize {
    if value >= 1 << 28 {
        let mut v = value;
        let mut n = 0;
        while v >= 0x80 {
            out[n] = (v as u8) | 0x80;
            v >>= 7;
            n += 1;
        }
        out[n] = v as u8;
        return n + 1;
    }
    let len = 1
        + usize::from(value >= 1 << 7)
        + usize::from(value >= 1 << 14)
        + usize::from(value >= 1 << 21);
    let groups = (value & 0x7f)
        | ((value << 1) & 0x7f00)
        | ((value << 2) & 0x7f_0000)
        | ((value << 3) & 0x7f00_0000);
    let continuation = 0x0080_8080u32 >> (8 * (4 - len));
    out[..4].copy_from_slice(&(groups | continuation).to_le_bytes());
    len
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
        n += put_varint(value, &mut chunk[n..]);
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

    /// Every varint length, at every offset in the stack buffer (values of mixed lengths so
    /// that the buffer's flushes fall between and after each kind), against prost's encoder.
    #[test]
    fn packed_fields_are_prosts_byte_for_byte() {
        let mut edges = vec![0u32, 1, u32::MAX, u32::MAX - 1];
        for shift in [7, 14, 21, 28] {
            edges.extend([(1u32 << shift) - 1, 1 << shift, (1 << shift) + 1]);
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut values = Vec::new();
        for len in [0usize, 1, 2, 101, 102, 103, 104, 3_001] {
            values.clear();
            for i in 0..len {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                // Mostly token-id sized values, with every edge mixed in.
                let v = if i % 5 == 0 {
                    edges[(state as usize) % edges.len()]
                } else {
                    (state >> 40) as u32 >> ((state >> 8) as u32 % 24)
                };
                values.push(v);
            }
            let mut ours = Vec::new();
            encode_packed_u32(2, &values, &mut ours);
            let mut theirs = Vec::new();
            uint32::encode_packed(2, &values, &mut theirs);
            assert_eq!(ours, theirs, "{len} values");
            assert_eq!(
                encoded_len_packed_u32(2, &values),
                uint32::encoded_len_packed(2, &values),
                "{len} values"
            );
            assert_eq!(ours.len(), encoded_len_packed_u32(2, &values));
        }
    }
}
