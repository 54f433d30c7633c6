//! TFRecord framing: `u64 length (LE) | u32 masked CRC32C(length) | data | u32 masked CRC32C(data)`.
//!
//! [`Scanner`] walks a shard and yields each record's position, validating the length CRC always and
//! the data CRC when asked. Errors carry the byte offset of the frame that failed. The writer side is
//! just the frame header and footer, because batch bodies are assembled from pieces.

use crate::crc;
use thiserror::Error;

/// Bytes of framing before a record's data.
pub const HEADER_LEN: u64 = 12;
/// Bytes of framing after a record's data.
pub const FOOTER_LEN: u64 = 4;
/// Largest record accepted (a corrupt length must not make us reserve absurd ranges).
pub const MAX_RECORD_LEN: u64 = 1 << 40;

/// A framing error, at byte `offset` of the shard (the start of the bad frame).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TfRecordError {
    #[error("truncated record at byte {offset}: frame needs {needed} bytes, {available} remain")]
    Truncated { offset: u64, needed: u64, available: u64 },
    #[error("bad length CRC at byte {offset} (is this a TFRecord file?)")]
    BadLengthCrc { offset: u64 },
    #[error("bad data CRC for the record at byte {offset} ({len} bytes): the data is corrupt")]
    BadDataCrc { offset: u64, len: u64 },
    #[error("record at byte {offset} claims {len} bytes, over the {MAX_RECORD_LEN}-byte limit")]
    TooLong { offset: u64, len: u64 },
}

impl TfRecordError {
    /// Whether scanning can continue after this error (the frame itself was intact).
    pub fn is_recoverable(&self) -> bool {
        matches!(self, TfRecordError::BadDataCrc { .. })
    }
}

/// One record found in a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordPos {
    /// Offset of the frame (its length field).
    pub frame_offset: u64,
    /// Length of the record's data.
    pub len: u64,
    /// The unmasked data CRC32C stored in the frame.
    pub data_crc: u32,
}

impl RecordPos {
    /// Offset of the record's data.
    pub fn data_offset(&self) -> u64 {
        self.frame_offset + HEADER_LEN
    }

    /// Size of the whole frame.
    pub fn frame_len(&self) -> u64 {
        frame_len(self.len)
    }
}

/// Size of the frame holding `len` data bytes.
pub fn frame_len(len: u64) -> u64 {
    HEADER_LEN + len + FOOTER_LEN
}

/// The 12-byte frame header for a record of `len` bytes.
pub fn frame_header(len: u64) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[..8].copy_from_slice(&len.to_le_bytes());
    out[8..].copy_from_slice(&crc::mask(crc::crc32c(&len.to_le_bytes())).to_le_bytes());
    out
}

/// The 4-byte frame footer for data whose CRC32C is `data_crc`.
pub fn frame_footer(data_crc: u32) -> [u8; 4] {
    crc::mask(data_crc).to_le_bytes()
}

/// Encodes one complete record (for generators and tests).
pub fn encode_record(data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&frame_header(data.len() as u64));
    out.extend_from_slice(data);
    out.extend_from_slice(&frame_footer(crc::crc32c(data)));
}

/// Walks the records of one shard held in memory (usually a mapped file).
pub struct Scanner<'a> {
    buf: &'a [u8],
    pos: u64,
    verify_data: bool,
    stopped: bool,
}

impl<'a> Scanner<'a> {
    /// Scans `buf`; `verify_data` also checks every record's data CRC.
    pub fn new(buf: &'a [u8], verify_data: bool) -> Self {
        Scanner { buf, pos: 0, verify_data, stopped: false }
    }

    /// Offset the scanner will read next.
    pub fn position(&self) -> u64 {
        self.pos
    }

    fn read_frame(&mut self) -> Result<RecordPos, TfRecordError> {
        let offset = self.pos;
        let available = self.buf.len() as u64 - offset;
        if available < HEADER_LEN {
            return Err(TfRecordError::Truncated { offset, needed: HEADER_LEN, available });
        }
        let start = offset as usize;
        let len_bytes: [u8; 8] = self.buf[start..start + 8].try_into().expect("8 bytes");
        let len_crc = u32::from_le_bytes(self.buf[start + 8..start + 12].try_into().expect("4 bytes"));
        if crc::mask(crc::crc32c(&len_bytes)) != len_crc {
            return Err(TfRecordError::BadLengthCrc { offset });
        }
        let len = u64::from_le_bytes(len_bytes);
        if len > MAX_RECORD_LEN {
            return Err(TfRecordError::TooLong { offset, len });
        }
        let needed = frame_len(len);
        if available < needed {
            return Err(TfRecordError::Truncated { offset, needed, available });
        }
        let data_start = start + HEADER_LEN as usize;
        let data_end = data_start + len as usize;
        let stored = crc::unmask(u32::from_le_bytes(self.buf[data_end..data_end + 4].try_into().expect("4 bytes")));
        self.pos = offset + needed;
        if self.verify_data && crc::crc32c(&self.buf[data_start..data_end]) != stored {
            return Err(TfRecordError::BadDataCrc { offset, len });
        }
        Ok(RecordPos { frame_offset: offset, len, data_crc: stored })
    }
}

impl Iterator for Scanner<'_> {
    type Item = Result<RecordPos, TfRecordError>;

    /// Yields records until the end of the shard. After an unrecoverable error (bad framing) it stops;
    /// after a bad data CRC it continues with the next frame.
    fn next(&mut self) -> Option<Self::Item> {
        if self.stopped || self.pos >= self.buf.len() as u64 {
            return None;
        }
        let item = self.read_frame();
        if let Err(e) = &item {
            self.stopped = !e.is_recoverable();
        }
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shard(records: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        for r in records {
            encode_record(r, &mut out);
        }
        out
    }

    #[test]
    fn known_frame() {
        // The frame TensorFlow writes for b"hello": length 5, masked CRCs as in the Python `tfrecord` package.
        let mut out = Vec::new();
        encode_record(b"hello", &mut out);
        assert_eq!(&out[..8], &5u64.to_le_bytes());
        assert_eq!(u32::from_le_bytes(out[8..12].try_into().unwrap()), crc::mask(crc::crc32c(&5u64.to_le_bytes())));
        assert_eq!(out.len(), 21);
    }

    #[test]
    fn bad_data_crc_is_reported_and_skippable() {
        let mut buf = shard(&[b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]);
        let second = frame_len(3) as usize;
        buf[second + HEADER_LEN as usize] ^= 0xff;
        let items: Vec<_> = Scanner::new(&buf, true).collect();
        assert_eq!(items.len(), 3);
        assert!(items[0].is_ok());
        assert_eq!(items[1], Err(TfRecordError::BadDataCrc { offset: second as u64, len: 3 }));
        assert!(items[2].is_ok());
        // Without data verification the corrupt record is indexed (its stored CRC kept).
        assert!(Scanner::new(&buf, false).all(|r| r.is_ok()));
    }

    #[test]
    fn bad_length_crc_stops() {
        let mut buf = shard(&[b"one".to_vec(), b"two".to_vec()]);
        buf[frame_len(3) as usize + 1] ^= 1;
        let items: Vec<_> = Scanner::new(&buf, true).collect();
        assert_eq!(items.len(), 2);
        assert_eq!(items[1], Err(TfRecordError::BadLengthCrc { offset: frame_len(3) }));
    }

    #[test]
    fn truncation_is_reported_with_offset() {
        let buf = shard(&[b"one".to_vec(), b"twotwo".to_vec()]);
        let cut = &buf[..buf.len() - 2];
        let items: Vec<_> = Scanner::new(cut, true).collect();
        assert_eq!(
            items[1],
            Err(TfRecordError::Truncated { offset: frame_len(3), needed: frame_len(6), available: frame_len(6) - 2 })
        );
    }

    proptest! {
        #[test]
        fn roundtrip(records in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..500), 0..20)) {
            let buf = shard(&records);
            let found: Vec<RecordPos> = Scanner::new(&buf, true).collect::<Result<_, _>>().unwrap();
            prop_assert_eq!(found.len(), records.len());
            for (pos, rec) in found.iter().zip(&records) {
                let data = &buf[pos.data_offset() as usize..(pos.data_offset() + pos.len) as usize];
                prop_assert_eq!(data, &rec[..]);
                prop_assert_eq!(pos.data_crc, crc::crc32c(rec));
            }
        }

        #[test]
        fn never_panics_on_garbage(buf in proptest::collection::vec(any::<u8>(), 0..300), verify: bool) {
            for item in Scanner::new(&buf, verify) { let _ = item; }
        }
    }
}
