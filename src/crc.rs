//! CRC32C (Castagnoli) helpers shared by the TFRecord framing and the batch checksums.
//!
//! Every checksum batchfs publishes is a plain CRC32C of the bytes it covers. Because CRC32C can be
//! *combined* (`crc(A ++ B)` from `crc(A)`, `crc(B)` and `len(B)`), the server derives the checksum of a
//! whole batch body from per-sample CRCs recorded at index time, without reading any sample data.

/// CRC32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// TFRecord's masked CRC: `((crc >> 15) | (crc << 17)) + 0xa282ead8`.
pub fn mask(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Inverse of [`mask`].
pub fn unmask(masked: u32) -> u32 {
    masked.wrapping_sub(0xa282_ead8).rotate_left(15)
}

/// A CRC32C accumulated over a sequence of pieces, some given as bytes and some only by their CRC and
/// length.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrcBuilder {
    crc: u32,
    len: u64,
}

impl CrcBuilder {
    /// An empty accumulator (CRC of zero bytes).
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes.
    pub fn push_bytes(&mut self, data: &[u8]) {
        self.crc = crc32c::crc32c_append(self.crc, data);
        self.len += data.len() as u64;
    }

    /// Appends a piece known only by its CRC32C and length.
    pub fn push_crc(&mut self, crc: u32, len: u64) {
        self.crc = combine(self.crc, crc, len);
        self.len += len;
    }

    /// The CRC32C of everything pushed so far.
    pub fn crc(&self) -> u32 {
        self.crc
    }

    /// How many bytes were pushed.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// `crc(A ++ B)` from `crc(A)`, `crc(B)` and `len(B)`.
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    if len_b == 0 {
        return crc_a;
    }
    // crc32c_combine takes usize; pieces larger than usize cannot exist in a mapped file anyway.
    crc32c::crc32c_combine(crc_a, crc_b, len_b as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_vectors() {
        // RFC 3720 B.4: 32 bytes of zeros.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    proptest! {
        #[test]
        fn mask_roundtrips(x: u32) {
            prop_assert_eq!(unmask(mask(x)), x);
        }

        #[test]
        fn builder_equals_direct(a in proptest::collection::vec(any::<u8>(), 0..300),
                                 b in proptest::collection::vec(any::<u8>(), 0..300),
                                 c in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut builder = CrcBuilder::new();
            builder.push_bytes(&a);
            builder.push_crc(crc32c(&b), b.len() as u64);
            builder.push_bytes(&c);
            let all: Vec<u8> = a.iter().chain(&b).chain(&c).copied().collect();
            prop_assert_eq!(builder.crc(), crc32c(&all));
            prop_assert_eq!(builder.len(), all.len() as u64);
        }
    }
}
