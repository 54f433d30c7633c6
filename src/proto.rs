//! The little protobuf this project needs: walking the fields of a message (to read labels and keys out
//! of `tf.train.Example` and Caffe `Datum` records at index time) and writing `tf.train.Example` wrappers
//! around samples from non-TFRecord sources.
//!
//! Writing works on [`Piece`] lists rather than byte buffers, because a wrapped sample's bytes stay in
//! the mapped shard: an Example is "inline header bytes, then sample part k, then more inline bytes".

use thiserror::Error;

/// A malformed protobuf message.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtoError {
    #[error("protobuf message truncated at byte {0}")]
    Truncated(usize),
    #[error("protobuf varint too long at byte {0}")]
    VarintOverflow(usize),
    #[error("unsupported protobuf wire type {wire_type} at byte {offset}")]
    WireType { wire_type: u8, offset: usize },
}

/// One field's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

/// Iterates over the `(field number, value)` pairs of one message.
pub struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
    failed: bool,
}

/// Walks the top-level fields of `buf`.
pub fn fields(buf: &[u8]) -> Fields<'_> {
    Fields { buf, pos: 0, failed: false }
}

fn read_varint(buf: &[u8], pos: &mut usize) -> Result<u64, ProtoError> {
    let start = *pos;
    let mut value = 0u64;
    for shift in (0..70).step_by(7) {
        let Some(&byte) = buf.get(*pos) else {
            return Err(ProtoError::Truncated(*pos));
        };
        *pos += 1;
        if shift == 63 && byte > 1 {
            return Err(ProtoError::VarintOverflow(start));
        }
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(ProtoError::VarintOverflow(start))
}

impl<'a> Fields<'a> {
    fn next_field(&mut self) -> Result<(u32, Value<'a>), ProtoError> {
        let offset = self.pos;
        let key = read_varint(self.buf, &mut self.pos)?;
        let field = (key >> 3) as u32;
        let wire_type = (key & 7) as u8;
        let take = |pos: &mut usize, n: usize| -> Result<&'a [u8], ProtoError> {
            let end = pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or(ProtoError::Truncated(*pos))?;
            let out = &self.buf[*pos..end];
            *pos = end;
            Ok(out)
        };
        let value = match wire_type {
            0 => Value::Varint(read_varint(self.buf, &mut self.pos)?),
            1 => Value::Fixed64(u64::from_le_bytes(take(&mut self.pos, 8)?.try_into().expect("8 bytes"))),
            2 => {
                let len = read_varint(self.buf, &mut self.pos)?;
                let len = usize::try_from(len).map_err(|_| ProtoError::Truncated(self.pos))?;
                Value::Bytes(take(&mut self.pos, len)?)
            }
            5 => Value::Fixed32(u32::from_le_bytes(take(&mut self.pos, 4)?.try_into().expect("4 bytes"))),
            other => return Err(ProtoError::WireType { wire_type: other, offset }),
        };
        Ok((field, value))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), ProtoError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.pos >= self.buf.len() {
            return None;
        }
        let item = self.next_field();
        self.failed = item.is_err();
        Some(item)
    }
}

/// A value of a `tf.train.Feature` that batchfs reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeatureValue<'a> {
    Bytes(Vec<&'a [u8]>),
    Int64(Vec<i64>),
    Float,
}

/// Finds feature `name` in a serialized `tf.train.Example`.
pub fn example_feature<'a>(example: &'a [u8], name: &str) -> Result<Option<FeatureValue<'a>>, ProtoError> {
    for field in fields(example) {
        let (1, Value::Bytes(features)) = field? else {
            continue;
        };
        for entry in fields(features) {
            let (1, Value::Bytes(entry)) = entry? else {
                continue;
            };
            let mut key = None;
            let mut value = None;
            for kv in fields(entry) {
                match kv? {
                    (1, Value::Bytes(k)) => key = Some(k),
                    (2, Value::Bytes(v)) => value = Some(v),
                    _ => {}
                }
            }
            if key != Some(name.as_bytes()) {
                continue;
            }
            let Some(feature) = value else {
                return Ok(None);
            };
            for kind in fields(feature) {
                match kind? {
                    (1, Value::Bytes(list)) => {
                        let mut out = Vec::new();
                        for item in fields(list) {
                            if let (1, Value::Bytes(b)) = item? {
                                out.push(b);
                            }
                        }
                        return Ok(Some(FeatureValue::Bytes(out)));
                    }
                    (2, _) => return Ok(Some(FeatureValue::Float)),
                    (3, Value::Bytes(list)) => {
                        let mut out = Vec::new();
                        for item in fields(list) {
                            match item? {
                                (1, Value::Varint(v)) => out.push(v as i64),
                                (1, Value::Bytes(packed)) => {
                                    let mut pos = 0;
                                    while pos < packed.len() {
                                        out.push(read_varint(packed, &mut pos)? as i64);
                                    }
                                }
                                _ => {}
                            }
                        }
                        return Ok(Some(FeatureValue::Int64(out)));
                    }
                    _ => {}
                }
            }
            return Ok(None);
        }
    }
    Ok(None)
}

/// The label (field 5) of a serialized Caffe `Datum`, if the message parses and carries one.
pub fn datum_label(datum: &[u8]) -> Result<Option<i64>, ProtoError> {
    let mut label = None;
    for field in fields(datum) {
        if let (5, Value::Varint(v)) = field? {
            label = Some(v as i32 as i64);
        }
    }
    Ok(label)
}

/// Appends `value` as a varint.
pub fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Bytes needed to encode `value` as a varint.
pub fn varint_len(value: u64) -> u64 {
    u64::from((64 - (value | 1).leading_zeros()).div_ceil(7))
}

/// A piece of an encoded message: literal bytes, or the bytes of an external part known by length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Inline(Vec<u8>),
    /// Part number `index` of the sample being wrapped, `len` bytes long.
    Part {
        index: usize,
        len: u64,
    },
}

impl Piece {
    /// Length of this piece in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Piece::Inline(b) => b.len() as u64,
            Piece::Part { len, .. } => *len,
        }
    }

    /// Whether this piece is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn pieces_len(pieces: &[Piece]) -> u64 {
    pieces.iter().map(Piece::len).sum()
}

/// Pushes `bytes` as inline, merging with a preceding inline piece.
fn push_inline(out: &mut Vec<Piece>, bytes: &[u8]) {
    inline_tail(out).extend_from_slice(bytes);
}

/// What one feature of a wrapping Example holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WrapFeature<'a> {
    /// A `bytes_list` with one value: sample part `index` of `len` bytes.
    Part { index: usize, len: u64 },
    /// A `bytes_list` with one literal value.
    Bytes(&'a [u8]),
    /// An `int64_list` with one value.
    Int64(i64),
}

/// Encodes a `tf.train.Example` whose features are `features` (name, value), in the order given.
///
/// Every message's length is known before its bytes (each is a sum of its fields' sizes), so the
/// encoding is one pass into as few inline pieces as the parts allow: a manifest wraps every sample of
/// an epoch, a million at ImageNet's size, and nested buffers per field made this its main cost.
pub fn example_pieces(features: &[(&str, WrapFeature<'_>)]) -> Vec<Piece> {
    // The value's bytes (for Int64: its packed varint), in its list (field 1), in the Feature (field 1,
    // bytes_list, or 3, int64_list).
    let value_len = |v: &WrapFeature<'_>| match v {
        WrapFeature::Part { len, .. } => *len,
        WrapFeature::Bytes(b) => b.len() as u64,
        WrapFeature::Int64(x) => varint_len(*x as u64),
    };
    let list_field = |v: &WrapFeature<'_>| if matches!(v, WrapFeature::Int64(_)) { 3 } else { 1 };
    let list_len = |v: &WrapFeature<'_>| delimited_len(1, value_len(v));
    let feature_len = |v: &WrapFeature<'_>| delimited_len(list_field(v), list_len(v));
    // A map entry: key (field 1) and value (field 2).
    let entry_len =
        |name: &str, v: &WrapFeature<'_>| delimited_len(1, name.len() as u64) + delimited_len(2, feature_len(v));
    let features_len: u64 = features.iter().map(|(name, v)| delimited_len(1, entry_len(name, v))).sum();
    let mut out = Vec::new();
    head(&mut out, 1, features_len);
    for (name, value) in features {
        head(&mut out, 1, entry_len(name, value));
        head(&mut out, 1, name.len() as u64);
        push_inline(&mut out, name.as_bytes());
        head(&mut out, 2, feature_len(value));
        head(&mut out, list_field(value), list_len(value));
        head(&mut out, 1, value_len(value));
        match value {
            WrapFeature::Part { index, len } => out.push(Piece::Part { index: *index, len: *len }),
            WrapFeature::Bytes(b) => push_inline(&mut out, b),
            WrapFeature::Int64(x) => put_varint(inline_tail(&mut out), *x as u64),
        }
    }
    out
}

/// The size of length-delimited field `field` holding `len` bytes: tag, length, bytes.
fn delimited_len(field: u32, len: u64) -> u64 {
    varint_len(u64::from(field) << 3 | 2) + varint_len(len) + len
}

/// Appends the tag and length of length-delimited field `field` holding `len` bytes.
fn head(out: &mut Vec<Piece>, field: u32, len: u64) {
    let tail = inline_tail(out);
    put_varint(tail, u64::from(field) << 3 | 2);
    put_varint(tail, len);
}

/// The inline piece at the end of `out`, made if the last piece is a part (or there is none).
fn inline_tail(out: &mut Vec<Piece>) -> &mut Vec<u8> {
    if !matches!(out.last(), Some(Piece::Inline(_))) {
        // Room for the heads around a part and a short name or key, without growing.
        out.push(Piece::Inline(Vec::with_capacity(64)));
    }
    match out.last_mut() {
        Some(Piece::Inline(bytes)) => bytes,
        _ => unreachable!("pushed above"),
    }
}

/// Materializes pieces, given the sample parts' bytes.
pub fn pieces_to_bytes(pieces: &[Piece], parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(pieces_len(pieces) as usize);
    for piece in pieces {
        match piece {
            Piece::Inline(b) => out.extend_from_slice(b),
            Piece::Part { index, .. } => out.extend_from_slice(parts[*index]),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn varint_lengths() {
        for v in [0u64, 1, 127, 128, 16383, 16384, u64::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out.len() as u64, varint_len(v), "{v}");
            let mut pos = 0;
            assert_eq!(read_varint(&out, &mut pos).unwrap(), v);
        }
    }

    #[test]
    fn truncated_is_an_error() {
        let pieces = example_pieces(&[("data", WrapFeature::Bytes(b"hello"))]);
        let bytes = pieces_to_bytes(&pieces, &[]);
        for cut in 1..bytes.len() {
            // Must not panic; a cut message is either an error or simply lacks the feature.
            let _ = example_feature(&bytes[..cut], "data");
        }
        assert!(matches!(fields(&[0x0a, 0x05, 1]).next(), Some(Err(ProtoError::Truncated(_)))));
    }

    /// The encoder before `example_pieces` computed lengths first: nested buffers per field, each
    /// message built, measured and wrapped in its head. The reference the new one must match byte for
    /// byte and piece for piece (served batches and their checksums must not change).
    mod nested {
        use super::super::*;

        fn push_pieces(out: &mut Vec<Piece>, pieces: Vec<Piece>) {
            for piece in pieces {
                match piece {
                    Piece::Inline(b) => push_inline(out, &b),
                    part => out.push(part),
                }
            }
        }

        /// A length-delimited field `field` holding `inner`.
        fn len_delimited(field: u32, inner: Vec<Piece>) -> Vec<Piece> {
            let mut head = Vec::new();
            put_varint(&mut head, u64::from(field) << 3 | 2);
            put_varint(&mut head, pieces_len(&inner));
            let mut out = vec![Piece::Inline(head)];
            push_pieces(&mut out, inner);
            out
        }

        pub(super) fn example_pieces(features: &[(&str, WrapFeature<'_>)]) -> Vec<Piece> {
            let mut entries = Vec::new();
            for (name, value) in features {
                let feature = match value {
                    WrapFeature::Part { index, len } => {
                        len_delimited(1, len_delimited(1, vec![Piece::Part { index: *index, len: *len }]))
                    }
                    WrapFeature::Bytes(b) => len_delimited(1, len_delimited(1, vec![Piece::Inline(b.to_vec())])),
                    WrapFeature::Int64(v) => {
                        let mut packed = Vec::new();
                        put_varint(&mut packed, *v as u64);
                        len_delimited(3, len_delimited(1, vec![Piece::Inline(packed)]))
                    }
                };
                let mut entry = len_delimited(1, vec![Piece::Inline(name.as_bytes().to_vec())]);
                push_pieces(&mut entry, len_delimited(2, feature));
                push_pieces(&mut entries, len_delimited(1, entry));
            }
            len_delimited(1, entries)
        }
    }

    fn arb_feature() -> impl Strategy<Value = (String, u8, u64, Vec<u8>, i64)> {
        // Names of any length (and so heads of one or more varint bytes), values of each kind.
        (
            "[a-z/_.]{0,200}",
            0u8..3,
            prop_oneof![0u64..300, 0u64..100_000_000],
            proptest::collection::vec(any::<u8>(), 0..300),
            any::<i64>(),
        )
    }

    proptest! {
        #[test]
        fn examples_are_encoded_as_the_nested_encoder_did(features in proptest::collection::vec(arb_feature(), 0..6)) {
            let wrapped: Vec<(&str, WrapFeature<'_>)> = features
                .iter()
                .enumerate()
                .map(|(i, (name, kind, len, bytes, x))| {
                    let value = match kind {
                        0 => WrapFeature::Part { index: i, len: *len },
                        1 => WrapFeature::Bytes(bytes),
                        _ => WrapFeature::Int64(*x),
                    };
                    (name.as_str(), value)
                })
                .collect();
            prop_assert_eq!(example_pieces(&wrapped), nested::example_pieces(&wrapped));
        }

        #[test]
        fn example_roundtrip(data in proptest::collection::vec(any::<u8>(), 0..2000),
                             key in "[a-z0-9/_]{0,40}", label in any::<i64>()) {
            let pieces = example_pieces(&[
                ("data", WrapFeature::Part { index: 0, len: data.len() as u64 }),
                ("key", WrapFeature::Bytes(key.as_bytes())),
                ("label", WrapFeature::Int64(label)),
            ]);
            let bytes = pieces_to_bytes(&pieces, &[&data]);
            prop_assert_eq!(bytes.len() as u64, pieces_len(&pieces));
            prop_assert_eq!(example_feature(&bytes, "data").unwrap(), Some(FeatureValue::Bytes(vec![&data[..]])));
            prop_assert_eq!(example_feature(&bytes, "key").unwrap(), Some(FeatureValue::Bytes(vec![key.as_bytes()])));
            prop_assert_eq!(example_feature(&bytes, "label").unwrap(), Some(FeatureValue::Int64(vec![label])));
            prop_assert_eq!(example_feature(&bytes, "missing").unwrap(), None);
        }

        #[test]
        fn fields_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            for f in fields(&bytes) { let _ = f; }
            let _ = example_feature(&bytes, "label");
            let _ = datum_label(&bytes);
        }
    }
}
