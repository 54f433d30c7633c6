//! What an object's ETag says of its bytes: the check that keeps a copy corrupted on its way from the store
//! out of the index, whose CRC32Cs every later read is checked against.
//!
//! - A single-part upload's ETag is the MD5 of its bytes: a copy matches it or is read again.
//! - A multipart upload's (`"HEX-N"`) is the MD5 of the concatenated MD5s of its `N` parts, which depends on
//!   the part size the uploader chose. `object_store` cannot ask S3 for it (`partNumber=1`), so the sizes
//!   uploaders use ([`part_sizes`]) are tried: one that gives the ETag proves the copy, as an MD5 does.
//! - Where none does (an uploader's own part size, parts of unequal sizes, a store whose ETags are no MD5s
//!   at all, or simply a corrupted copy, which no part size matches), the ETag says nothing, and the
//!   object is read again until two reads agree ([`Reads`]): transit corruption falls at other places in
//!   each read, so two reads corrupted on their way never agree (their CRC32Cs differ), and one right read
//!   agrees with the next right one. (Bytes the store holds or sends wrong the same way each time agree:
//!   only an ETag that is an MD5 catches those.) Reads that never agree fail indexing, naming the object
//!   ([`EtagError`]).
//!
//! The cost: an MD5 pass over the copy per part size tried (one, mostly: few part sizes give exactly `N`
//! parts of an object's size), and a second read only of the objects whose part size is not found.

use batchfs::index::ShardInfo;
use md5::{Digest, Md5};

/// At most this many part sizes are tried for a multipart ETag (an MD5 pass over the copy each).
const MAX_PART_SIZES: usize = 6;

const MIB: u64 = 1 << 20;

/// The part sizes uploaders use, most used first: the aws CLI and boto3 (8 MiB), S3's least and most
/// SDKs', rclone's and `object_store`'s (5 MiB), MinIO's `mc` (16 MiB), s3cmd (15 MiB), 10 MiB, Hadoop
/// s3a (64 MiB, 100 MiB before), s5cmd (50 MiB), then the larger powers of two.
const COMMON_PART_SIZES: [u64; 12] = [8, 5, 16, 15, 10, 64, 100, 50, 32, 128, 256, 512];

/// A copy read while indexing that could not be taken: each says which object and what to do.
#[derive(Debug, thiserror::Error)]
pub enum EtagError {
    #[error(
        "{dataset}/{object}: each of {reads} copies read differs from the object's MD5 (its ETag): the bytes are \
         corrupted between the store and this server (a proxy, a NIC, the network); not indexed"
    )]
    Differs { dataset: String, object: String, reads: u32 },
    #[error(
        "{dataset}/{object}: a multipart upload (ETag {etag}) whose part size is none of those tried, read \
         {reads} times, and no two reads agreed: the bytes are corrupted between the store and this server, or \
         the object is being rewritten; not indexed (nothing of it is served)"
    )]
    NeverAgreed { dataset: String, object: String, etag: String, reads: u32 },
}

/// What the ETag says of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The ETag is the copy's MD5, or its multipart MD5 for one of the part sizes tried.
    Matches,
    /// The ETag is an MD5 and the copy's differs: a corrupted copy.
    Differs,
    /// The ETag cannot tell (a multipart one for no part size tried, or no MD5 at all).
    Unknown,
}

/// What `etag` says of `bytes`.
pub(super) fn verdict(etag: &str, bytes: &[u8]) -> Verdict {
    if let Some(md5) = etag_md5(etag) {
        return if Md5::digest(bytes)[..] == md5 { Verdict::Matches } else { Verdict::Differs };
    }
    let Some((md5, parts)) = multipart(etag) else { return Verdict::Unknown };
    let size = bytes.len() as u64;
    match part_sizes(size, parts).into_iter().any(|part| multipart_md5(bytes, part) == md5) {
        true => Verdict::Matches,
        false => Verdict::Unknown,
    }
}

/// The MD5 an ETag is, where it is one (a single-part upload's: 32 hex digits, quoted).
fn etag_md5(etag: &str) -> Option<[u8; 16]> {
    hex_md5(etag.trim_matches('"'))
}

fn hex_md5(hex: &str) -> Option<[u8; 16]> {
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// A multipart upload's ETag (`"HEX-N"`): the MD5 of its parts' MD5s, and `N`.
fn multipart(etag: &str) -> Option<([u8; 16], u64)> {
    let (hex, parts) = etag.trim_matches('"').split_once('-')?;
    let parts: u64 = parts.parse().ok().filter(|&n| n >= 1)?;
    Some((hex_md5(hex)?, parts))
}

/// The MD5 of the MD5s of `bytes` cut in parts of `part` bytes (the last one shorter): a multipart upload's
/// ETag, without its `-N`. An empty object is one empty part.
fn multipart_md5(bytes: &[u8], part: u64) -> [u8; 16] {
    let part = usize::try_from(part).unwrap_or(usize::MAX).max(1);
    let mut of_parts = Md5::new();
    if bytes.is_empty() {
        of_parts.update(Md5::digest(bytes));
    }
    for chunk in bytes.chunks(part) {
        of_parts.update(Md5::digest(chunk));
    }
    of_parts.finalize().into()
}

/// The part sizes to try for an object of `size` bytes uploaded in `parts` parts, most likely first, at
/// most [`MAX_PART_SIZES`]: those of [`COMMON_PART_SIZES`], the aws CLI's 8 MiB doubled until 10,000 parts
/// hold the object, and sizes deduced from `parts` (the size over `parts` as it is, and rounded up to a MiB
/// and to 16 MiB, as SDKs that size parts to the object do), each kept only where it cuts `size` bytes into
/// exactly `parts` parts. One part: the object itself.
fn part_sizes(size: u64, parts: u64) -> Vec<u64> {
    if parts == 1 {
        return vec![size];
    }
    let even = size.div_ceil(parts);
    let doubled = (0..10).map(|k| (8 * MIB) << k).filter(|&p| size.div_ceil(p) <= 10_000).take(1);
    let deduced = [even, even.next_multiple_of(MIB), even.next_multiple_of(16 * MIB)];
    let mut out: Vec<u64> = Vec::new();
    for part in COMMON_PART_SIZES.iter().map(|m| m * MIB).chain(doubled).chain(deduced) {
        if part > 0 && size.div_ceil(part) == parts && !out.contains(&part) {
            out.push(part);
        }
    }
    out.truncate(MAX_PART_SIZES);
    out
}

/// The reads of one object while it is indexed, until one can be taken: one its ETag vouches for, or, where
/// the ETag cannot tell, one that agrees (by CRC32C) with an earlier read of the object.
#[derive(Default)]
pub(super) struct Reads {
    /// The CRC32Cs of the reads so far the ETag could not vouch for.
    unvouched: Vec<u32>,
}

/// What became of one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Judged {
    /// Taken: the ETag vouches for it, or an earlier read agrees.
    Take,
    /// Read it again: it differs from the ETag's MD5, or from every earlier read (`corrupt`: then a read
    /// was corrupted, this one or an earlier one), or it is the first read the ETag cannot tell of.
    Again { corrupt: bool },
}

impl Reads {
    /// Judges a read of an object whose ETag is `etag`: its bytes `bytes`.
    pub(super) fn judge(&mut self, etag: &str, bytes: &[u8]) -> Judged {
        match verdict(etag, bytes) {
            Verdict::Matches => Judged::Take,
            Verdict::Differs => Judged::Again { corrupt: true },
            Verdict::Unknown => {
                let crc = batchfs::crc::crc32c(bytes);
                if self.unvouched.contains(&crc) {
                    return Judged::Take;
                }
                self.unvouched.push(crc);
                Judged::Again { corrupt: self.unvouched.len() > 1 }
            }
        }
    }

    /// Why no read of `file` (from `dataset`), `reads` of them, could be taken.
    pub(super) fn refused(&self, dataset: &str, file: &ShardInfo, reads: u32) -> EtagError {
        let (dataset, object) = (dataset.to_owned(), file.path.to_string());
        match etag_md5(&file.etag.to_string()) {
            Some(_) => EtagError::Differs { dataset, object, reads },
            None => EtagError::NeverAgreed { dataset, object, etag: file.etag.to_string(), reads },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_single_part_etag_is_an_md5() {
        assert_eq!(
            etag_md5("\"d41d8cd98f00b204e9800998ecf8427e\""),
            Some(*b"\xd4\x1d\x8c\xd9\x8f\x00\xb2\x04\xe9\x80\x09\x98\xec\xf8\x42\x7e")
        );
        assert_eq!(etag_md5("\"d41d8cd98f00b204e9800998ecf8427e-3\""), None);
        assert_eq!(etag_md5("W/\"xyz\""), None);
        assert_eq!(etag_md5(""), None);
    }

    /// Bytes that are no pattern a wrong cut could match by chance.
    fn bytes(len: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// The reference: S3's multipart ETag as its documentation and every tool computes it, written out here
    /// with the `md-5` crate over the parts cut by hand.
    fn reference(bytes: &[u8], part: usize) -> String {
        let mut md5s = Vec::new();
        let mut n = 0;
        let mut at = 0;
        while at < bytes.len() {
            let end = (at + part).min(bytes.len());
            md5s.extend_from_slice(&Md5::digest(&bytes[at..end]));
            at = end;
            n += 1;
        }
        let hex: String = Md5::digest(&md5s).iter().map(|b| format!("{b:02x}")).collect();
        format!("\"{hex}-{n}\"")
    }

    /// Known vectors, computed apart (Python's `hashlib` over the same bytes, cut by hand), and the same
    /// computation written out with the `md-5` crate for other sizes: the ETags SeaweedFS and boto3 gave an
    /// object uploaded in parts of 5 MiB and of 8 MiB were these, computed so.
    #[test]
    fn the_multipart_etag_of_known_parts_is_the_md5_of_their_md5s() {
        let counted: Vec<u8> = (0..(12 << 20) + 5).map(|i| (i % 251) as u8).collect();
        for (part, etag) in
            [(5 << 20, "\"14a1e722095032d421357c2e3d1088a5-3\""), (8 << 20, "\"a4b2dbb31baccb1bf9637292d80f4295-2\"")]
        {
            assert_eq!(reference(&counted, part), etag);
            assert_eq!(verdict(etag, &counted), Verdict::Matches, "part size {part}");
        }
        // One empty part: the MD5 of the empty string's MD5.
        assert_eq!(verdict("\"59adb24ef3cdbe0297f05b395827453f-1\"", b""), Verdict::Matches);
        let data = bytes((21 << 20) + 12_345);
        for part in [5 << 20, 8 << 20, 16 << 20] {
            let etag = reference(&data, part);
            let (md5, parts) = multipart(&etag).unwrap();
            assert_eq!(multipart_md5(&data, part as u64), md5, "part size {part}");
            assert_eq!(parts, data.len().div_ceil(part) as u64);
            assert_eq!(verdict(&etag, &data), Verdict::Matches, "part size {part}");
        }
    }

    #[test]
    fn a_corrupted_copy_or_an_unknown_part_size_is_unknown_never_a_match() {
        let mut data = bytes((21 << 20) + 12_345);
        // An uploader's own part size (7 MiB): none of the sizes tried.
        assert_eq!(verdict(&reference(&data, 7 << 20), &data), Verdict::Unknown);
        // The aws CLI's, with one byte flipped on the way.
        let etag = reference(&data, 8 << 20);
        data[12 << 20] ^= 0x10;
        assert_eq!(verdict(&etag, &data), Verdict::Unknown);
        // A single-part upload's MD5 tells a corrupted copy from a right one.
        let md5: String = Md5::digest(b"right").iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(verdict(&format!("\"{md5}\""), b"right"), Verdict::Matches);
        assert_eq!(verdict(&format!("\"{md5}\""), b"wrong"), Verdict::Differs);
        // Not an ETag of S3's making: nothing to check against.
        assert_eq!(verdict("\"abc-2\"", &data), Verdict::Unknown);
        assert_eq!(verdict("\"0123\"", &data), Verdict::Unknown);
    }

    #[test]
    fn the_part_sizes_tried_cut_the_object_in_exactly_its_parts() {
        // 100 MB by the aws CLI: 12 parts of 8 MiB; 8 MiB is the first tried.
        assert_eq!(part_sizes(100_000_000, 12)[0], 8 * MIB);
        // An object of 2 GB by 10,000 parts at most: 8 MiB doubled (the aws CLI's adjusted size).
        let huge = 200_000 * MIB;
        assert!(part_sizes(huge, huge.div_ceil(32 * MIB)).contains(&(32 * MIB)));
        // Deduced from N: 1000 parts of 13 MiB (no size in the list).
        let odd = 999 * 13 * MIB + 7;
        assert!(part_sizes(odd, 1000).contains(&(13 * MIB)));
        for (size, parts) in [(100_000_000, 12), (huge, 7), (odd, 1000), (10 * MIB, 2), (1, 1), (0, 1)] {
            let tried = part_sizes(size, parts);
            assert!(tried.len() <= MAX_PART_SIZES);
            assert!(tried.iter().all(|&p| size.div_ceil(p.max(1)).max(1) == parts), "{size} {parts}: {tried:?}");
        }
        assert_eq!(part_sizes(12_345, 1), vec![12_345]);
    }

    #[test]
    fn reads_the_etag_cannot_tell_of_are_taken_once_two_agree() {
        // Three parts of a MiB and 50 bytes: a part size none of the ways tried gives.
        let data = bytes((3 << 20) + 100);
        let etag = reference(&data, (1 << 20) + 50);
        assert_eq!(verdict(&etag, &data), Verdict::Unknown);
        let file = ShardInfo {
            path: "shard.tar".into(),
            size: data.len() as u64,
            mtime_ns: 0,
            etag: batchfs::index::ETag::new(&etag),
            crc32c: 0,
            chunks: Default::default(),
        };
        let mut bad = data.clone();
        bad[5] ^= 1;
        let mut worse = data.clone();
        worse[1 << 21] ^= 4;
        let mut reads = Reads::default();
        assert_eq!(reads.judge(&etag, &bad), Judged::Again { corrupt: false });
        assert_eq!(reads.judge(&etag, &worse), Judged::Again { corrupt: true });
        assert_eq!(reads.judge(&etag, &data), Judged::Again { corrupt: true });
        assert_eq!(reads.judge(&etag, &data), Judged::Take);
        assert_eq!(reads.unvouched.len(), 3);
        assert!(matches!(reads.refused("s3://b/p", &file, 8), EtagError::NeverAgreed { reads: 8, .. }));
    }
}
