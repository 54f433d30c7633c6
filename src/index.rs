//! The dataset index: for every sample its key, label and parts (shard, byte offset, length, CRC32C),
//! built once and persisted so serving never walks a cursor or scans a shard (LMDBIO's lesson).
//!
//! On disk the index is `BATCHFSI`, the file's layout, a little-endian payload (first the format and the
//! version of its rules) and a CRC32C of all before it. A file that fails any check is ignored (and
//! rebuilt), never trusted; one of another layout or of other rules for its format is rebuilt whole.
//!
//! In memory a server holds the index of every dataset it serves, a sample and a file (a
//! [`ShardInfo`]) per image of a file tree or bucket: they are held in the compact forms of
//! `index/compact.rs` (56 and 72 bytes, and the key's and the path's text), and the index persisted
//! for a dataset listed now is taken with the listed files ([`Index::from_bytes_listed`]), so each path
//! is held once. These forms change nothing on disk: the bytes read are the bytes written again.

use crate::crc;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

mod compact;
pub use compact::{hex_pair, ChunkCrcs, ETag, Ext, Exts, Name, Parts};

/// The kind of source a dataset directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceFormat {
    /// `*.tfrecord`, `*.tfrecords`, `*.tfr` shards.
    Tfrecord,
    /// An LMDB environment (`data.mdb`).
    Lmdb,
    /// WebDataset `*.tar` shards.
    Tar,
    /// A plain file tree (ImageFolder layout).
    Files,
}

impl SourceFormat {
    /// All formats, in detection order.
    pub const ALL: [SourceFormat; 4] =
        [SourceFormat::Lmdb, SourceFormat::Tfrecord, SourceFormat::Tar, SourceFormat::Files];

    /// The name used on the command line and in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceFormat::Tfrecord => "tfrecord",
            SourceFormat::Lmdb => "lmdb",
            SourceFormat::Tar => "tar",
            SourceFormat::Files => "files",
        }
    }

    fn code(self) -> u8 {
        match self {
            SourceFormat::Tfrecord => 1,
            SourceFormat::Lmdb => 2,
            SourceFormat::Tar => 3,
            SourceFormat::Files => 4,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        SourceFormat::ALL.into_iter().find(|f| f.code() == code)
    }

    /// The version of this format's indexing rules: raised whenever indexing the same files of this format
    /// would make another index (what a sample is, its key, its parts), so that an index of this format
    /// made by other rules is rebuilt whole, never loaded or taken from, and its id differs, while the
    /// other formats' indexes are kept. 6 for every format is what the index file's layout 6 held, when one
    /// version stood for the layout and every format's rules (5: tar members as WebDataset reads them, an
    /// LMDB of duplicate keys refused, links followed; 6: an LMDB environment with a key that is not UTF-8
    /// has every key in hex).
    pub fn rules(self) -> u32 {
        match self {
            SourceFormat::Tfrecord | SourceFormat::Lmdb | SourceFormat::Tar | SourceFormat::Files => 6,
        }
    }
}

impl fmt::Display for SourceFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SourceFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SourceFormat::ALL
            .into_iter()
            .find(|f| f.as_str() == s)
            .ok_or_else(|| format!("unknown source format {s:?}: expected tfrecord, lmdb, tar or files"))
    }
}

/// Files are checked by chunks of this many bytes when read in ranges (`raw/`): a file larger than one
/// chunk carries the CRC32C of each ([`ShardInfo::chunks`]).
pub const CHUNK_BYTES: u64 = 4 << 20;

/// A file of the dataset (a shard, or a file beside the shards) as it was when indexed; a change of
/// size, mtime or (an object's) ETag makes the index stale.
///
/// A tree of a million files holds a million of these: the path is a [`Name`] (no spare capacity), the ETag
/// compact ([`ETag`]), and the chunk list a thin pointer, null for a file of one chunk ([`ChunkCrcs`]):
/// 72 bytes and the path's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardInfo {
    /// Path relative to the dataset root, `/`-separated.
    pub path: Name,
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// An object's entity tag as the store listed it (empty for a local file): a rewritten object has a
    /// new one.
    pub etag: ETag,
    /// CRC32C of the whole file (computed while indexing; 0 before).
    pub crc32c: u32,
    /// CRC32C of each [`CHUNK_BYTES`] chunk, the last one shorter, when the file is larger than one
    /// chunk; empty otherwise (the one chunk's CRC is [`ShardInfo::crc32c`]).
    pub chunks: ChunkCrcs,
}

impl ShardInfo {
    /// Same file as when indexed: path, size, mtime and ETag (the CRC is not recomputed to compare).
    pub fn same_file(&self, other: &ShardInfo) -> bool {
        self.path == other.path && self.size == other.size && self.mtime_ns == other.mtime_ns && self.etag == other.etag
    }

    /// Sets the whole file's CRC32C and its chunks' from its bytes (one pass).
    pub fn checksum(&mut self, bytes: &[u8]) {
        let (whole, chunks) = chunk_crcs(bytes);
        self.crc32c = whole;
        self.chunks = chunks;
    }

    /// The CRC32C of chunk `n` (of [`CHUNK_BYTES`]), if the file has it.
    pub fn chunk_crc(&self, n: u64) -> Option<u32> {
        if self.chunks.is_empty() {
            (n == 0).then_some(self.crc32c)
        } else {
            self.chunks.get(n as usize).copied()
        }
    }
}

/// Chunks of [`CHUNK_BYTES`] a file of `size` bytes has (at least one).
pub fn chunk_count(size: u64) -> u64 {
    size.div_ceil(CHUNK_BYTES).max(1)
}

/// The CRC32C of `bytes` and, when they are longer than one chunk, of each [`CHUNK_BYTES`] chunk.
pub fn chunk_crcs(bytes: &[u8]) -> (u32, ChunkCrcs) {
    if bytes.len() as u64 <= CHUNK_BYTES {
        return (crc::crc32c(bytes), ChunkCrcs::default());
    }
    let chunks: ChunkCrcs = bytes.chunks(CHUNK_BYTES as usize).map(crc::crc32c).collect();
    let whole = bytes
        .chunks(CHUNK_BYTES as usize)
        .zip(chunks.iter())
        .fold(crc::crc32c(&[]), |acc, (c, &crc)| crc::combine(acc, crc, c.len() as u64));
    (whole, chunks)
}

/// One stored piece of a sample (a WebDataset sample has one part per file extension).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Extension naming the part (`jpg`, `cls`, `example`, `datum`...).
    pub ext: Ext,
    /// Index into [`Index::shards`].
    pub shard: u32,
    /// Byte offset of the part's data in the shard.
    pub offset: u64,
    pub len: u64,
    /// CRC32C of the part's data.
    pub crc32c: u32,
}

/// One sample.
///
/// A dataset of a million samples holds a million of these: the key is a [`Name`] (no spare capacity)
/// and a single part is inline ([`Parts`]): 56 bytes and the key's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// Unique name of the sample within the dataset.
    pub key: Name,
    /// Class label, or [`NO_LABEL`].
    pub label: i64,
    pub parts: Parts,
}

/// Label of a sample that has none.
pub const NO_LABEL: i64 = -1;

impl Sample {
    /// Bytes of sample data (all parts).
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.len).sum()
    }
}

/// A corrupt region that `--skip-corrupt` indexed around.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    pub shard: String,
    pub offset: u64,
    pub reason: String,
}

/// Options that change what an index contains; an index built with other settings is rebuilt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexSettings {
    pub format: SourceFormat,
    pub verify_data_crc: bool,
    pub skip_corrupt: bool,
}

/// A dataset's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Index {
    pub settings: IndexSettings,
    pub shards: Vec<ShardInfo>,
    /// Other regular files in the dataset directory (`.idx` files, READMEs...): no samples, served as
    /// they are under `raw/`. Sorted by path.
    pub side: Vec<ShardInfo>,
    pub samples: Vec<Sample>,
    /// Class names, label `i` naming `classes[i]` (file trees; empty where labels are bare numbers).
    pub classes: Vec<String>,
    pub skipped: Vec<Skipped>,
}

impl Index {
    /// The source format.
    pub fn format(&self) -> SourceFormat {
        self.settings.format
    }

    /// What identifies the bytes this index serves, not when they were written: CRC-64/NVME over the
    /// version of its format's rules ([`SourceFormat::rules`]), the format, every file's path, size and
    /// CRC32C (shards, then side files) and the corrupt regions left out. A dataset indexed again
    /// unchanged (its files touched, or uploaded again alike, or indexed with `skip_corrupt` where nothing
    /// is corrupt) keeps it; a file added, removed or changed changes it, and so does a server of other
    /// rules for the format. A mount compares it with its own to tell a dataset re-indexed under it
    /// (`DatasetInfo::index_id`).
    pub fn content_id(&self) -> u64 {
        self.content_id_of(self.settings.format.rules())
    }

    /// [`Index::content_id`] as an index of `rules` has it.
    fn content_id_of(&self, rules: u32) -> u64 {
        let mut digest = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc64Nvme);
        // The rules too: an index of other rules may serve other bytes from the same files (rules 6 gave
        // an LMDB environment's keys in hex where one is not UTF-8).
        digest.update(&rules.to_le_bytes());
        digest.update(&[self.settings.format.code()]);
        for files in [&self.shards, &self.side] {
            digest.update(&(files.len() as u64).to_le_bytes());
            for f in files {
                digest.update(f.path.as_bytes());
                digest.update(&[0]);
                digest.update(&f.size.to_le_bytes());
                digest.update(&f.crc32c.to_le_bytes());
            }
        }
        for s in &self.skipped {
            digest.update(s.shard.as_bytes());
            digest.update(&[0]);
            digest.update(&s.offset.to_le_bytes());
        }
        digest.finalize()
    }

    /// Total bytes of sample data.
    pub fn total_bytes(&self) -> u64 {
        self.samples.iter().map(Sample::bytes).sum()
    }

    /// Serializes the index.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.to_bytes_of(self.settings.format.rules())
    }

    /// [`Index::to_bytes`] as an index of `rules` has them.
    fn to_bytes_of(&self, rules: u32) -> Vec<u8> {
        let mut w = Writer::default();
        w.u8(self.settings.format.code());
        w.u64(u64::from(rules));
        w.u8(u8::from(self.settings.verify_data_crc));
        w.u8(u8::from(self.settings.skip_corrupt));
        for files in [&self.shards, &self.side] {
            w.u64(files.len() as u64);
            for s in files {
                w.str(&s.path);
                w.u64(s.size);
                w.u64(s.mtime_ns as u64);
                w.etag(&s.etag);
                w.u64(u64::from(s.crc32c));
                // As many as the size says (none for a file of one chunk).
                for &c in s.chunks.iter() {
                    w.u32(c);
                }
            }
        }
        w.u64(self.classes.len() as u64);
        for c in &self.classes {
            w.str(c);
        }
        w.u64(self.skipped.len() as u64);
        for s in &self.skipped {
            w.str(&s.shard);
            w.u64(s.offset);
            w.str(&s.reason);
        }
        w.u64(self.samples.len() as u64);
        for s in &self.samples {
            w.str(&s.key);
            w.u64(s.label as u64);
            w.u64(s.parts.len() as u64);
            for p in &s.parts {
                w.str(&p.ext);
                w.u64(u64::from(p.shard));
                w.u64(p.offset);
                w.u64(p.len);
                w.u64(u64::from(p.crc32c));
            }
        }
        let mut out = Vec::with_capacity(w.0.len() + 16);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&LAYOUT.to_le_bytes());
        out.extend_from_slice(&w.0);
        // Over the head too: a layout's bit flipped is no payload read by another layout's rules.
        let sum = crc::crc32c(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// Parses an index written by [`Index::to_bytes`]; `None` if it is not one, is of another layout or of
    /// other rules for its format, or fails its checksum or any consistency check.
    pub fn from_bytes(buf: &[u8]) -> Option<Index> {
        Self::parse(buf, None).ok()
    }

    /// The settings an index of today's rules was built with, read from its head alone (no checksum
    /// checked): whether it is worth parsing whole.
    pub fn settings_of(buf: &[u8]) -> Option<IndexSettings> {
        let (layout, payload) = Self::layout(buf).ok()?;
        Self::head(&mut Reader(payload), layout).ok()
    }

    /// The layout of the index file `buf` and its payload (its checksum not yet checked).
    fn layout(buf: &[u8]) -> Result<(u32, &[u8]), Refused> {
        let rest = buf.strip_prefix(MAGIC).ok_or(Refused::Unreadable)?;
        let (layout, payload) = rest.split_first_chunk::<4>().ok_or(Refused::Unreadable)?;
        match u32::from_le_bytes(*layout) {
            layout @ (LAYOUT_6 | LAYOUT) => Ok((layout, payload)),
            _ => Err(Refused::Version),
        }
    }

    /// The settings at the head of a payload of `layout`, if made by today's rules for its format.
    fn head(r: &mut Reader, layout: u32) -> Result<IndexSettings, Refused> {
        let format = r.u8().and_then(SourceFormat::from_code).ok_or(Refused::Unreadable)?;
        // Layout 6 held no rules of its own: its version was every format's rules.
        let rules = match layout {
            LAYOUT_6 => Some(LAYOUT_6),
            _ => r.u64().and_then(|v| u32::try_from(v).ok()),
        };
        if rules.ok_or(Refused::Unreadable)? != format.rules() {
            return Err(Refused::Version);
        }
        let mut flag = || r.u8().map(|b| b != 0).ok_or(Refused::Unreadable);
        Ok(IndexSettings { format, verify_data_crc: flag()?, skip_corrupt: flag()? })
    }

    /// [`Index::from_bytes`] of the index persisted for a dataset listed now as `listed`: taken only if
    /// it was built with the listed settings, of the very files listed ([`ShardInfo::same_file`]). The
    /// index then holds the listed files (given the checksums it recorded; `listed` is left empty), not
    /// a copy read from `buf`: the paths of a million files are held once, never twice.
    pub fn from_bytes_listed(buf: &[u8], listed: &mut Listed) -> Result<Index, Refused> {
        Self::parse(buf, Some(listed))
    }

    fn parse(buf: &[u8], listed: Option<&mut Listed>) -> Result<Index, Refused> {
        let (layout, payload) = Self::layout(buf)?;
        let (payload, sum) = payload.split_at(payload.len().checked_sub(4).ok_or(Refused::Unreadable)?);
        // Layout 6's covered its payload alone.
        let covered = if layout == LAYOUT_6 { payload } else { &buf[..buf.len() - 4] };
        if sum.try_into().ok().map(u32::from_le_bytes) != Some(crc::crc32c(covered)) {
            return Err(Refused::Unreadable);
        }
        let mut r = Reader(payload);
        let settings = Self::head(&mut r, layout)?;
        let read = (|| {
            let shards = FilesRead::read(&mut r, listed.as_deref().map(|l| &l.shards[..]))?;
            let side = FilesRead::read(&mut r, listed.as_deref().map(|l| &l.side[..]))?;
            let classes = r.list(|r| r.str())?;
            let skipped = r.list(|r| Some(Skipped { shard: r.str()?, offset: r.u64()?, reason: r.str()? }))?;
            let mut exts = Exts::default();
            let mut part = |r: &mut Reader| {
                Some(Part {
                    ext: exts.get(r.text()?),
                    shard: u32::try_from(r.u64()?).ok()?,
                    offset: r.u64()?,
                    len: r.u64()?,
                    crc32c: u32::try_from(r.u64()?).ok()?,
                })
            };
            let samples = r.list(|r| {
                let (key, label) = (r.text()?.into(), r.u64()? as i64);
                // A single part straight into its place; several through a list.
                let parts = match r.u64()? {
                    1 => Parts::from(part(r)?),
                    n => r.items(n, &mut part)?.into(),
                };
                Some(Sample { key, label, parts })
            })?;
            r.0.is_empty().then_some((settings, shards, side, classes, skipped, samples))
        })();
        let (settings, shards, side, classes, skipped, samples) = read.ok_or(Refused::Unreadable)?;
        let (shards, side) = match (shards, side, listed) {
            (FilesRead::Whole(shards), FilesRead::Whole(side), None) => (shards, side),
            (FilesRead::Checksums(shards), FilesRead::Checksums(side), Some(listed)) if listed.settings == settings => {
                if !consistent(&samples, &listed.shards) {
                    return Err(Refused::Unreadable);
                }
                let take = |files: &mut Vec<ShardInfo>, sums: Vec<(u32, ChunkCrcs)>| {
                    for (file, (crc32c, chunks)) in files.iter_mut().zip(sums) {
                        (file.crc32c, file.chunks) = (crc32c, chunks);
                    }
                    std::mem::take(files)
                };
                (take(&mut listed.shards, shards), take(&mut listed.side, side))
            }
            _ => return Err(Refused::Stale),
        };
        let index = Index { settings, shards, side, samples, classes, skipped };
        match consistent(&index.samples, &index.shards) {
            true => Ok(index),
            false => Err(Refused::Unreadable),
        }
    }
}

/// Every part lies inside its shard.
fn consistent(samples: &[Sample], shards: &[ShardInfo]) -> bool {
    samples
        .iter()
        .flat_map(|s| &s.parts)
        .all(|p| shards.get(p.shard as usize).is_some_and(|s| p.offset.checked_add(p.len).is_some_and(|e| e <= s.size)))
}

/// A dataset as listed now, to take its persisted index ([`Index::from_bytes_listed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The settings the index should have been built with.
    pub settings: IndexSettings,
    pub shards: Vec<ShardInfo>,
    pub side: Vec<ShardInfo>,
}

/// Why a persisted index was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not an index, or damaged.
    Unreadable,
    /// An index of other settings, or of files that have changed since.
    Stale,
    /// An index of another layout, or of other rules for its format (an upgrade): rebuilt whole.
    Version,
}

/// One list of files (shards, or side files) as an index records it.
enum FilesRead {
    /// The files.
    Whole(Vec<ShardInfo>),
    /// Each file's checksums, the files being the very ones listed now.
    Checksums(Vec<(u32, ChunkCrcs)>),
    /// Not the files listed now.
    Differ,
}

impl FilesRead {
    /// The list at `r`: the files, or, given the files `listed` now, whether they are the same, and
    /// their checksums if so.
    fn read(r: &mut Reader, listed: Option<&[ShardInfo]>) -> Option<FilesRead> {
        let n = r.u64()?;
        let Some(listed) = listed else {
            return Some(FilesRead::Whole(r.items(n, |r| {
                let f = FileRecord::read(r)?;
                let (path, etag) = (f.path.into(), ETag::new(f.etag));
                Some(ShardInfo { path, size: f.size, mtime_ns: f.mtime_ns, etag, crc32c: f.crc32c, chunks: f.chunks })
            })?));
        };
        let mut same = n == listed.len() as u64;
        let mut at = listed.iter();
        let sums = r.items(n, |r| {
            let f = FileRecord::read(r)?;
            same &= at.next().is_some_and(|l| f.is(l));
            Some((f.crc32c, f.chunks))
        })?;
        Some(if same { FilesRead::Checksums(sums) } else { FilesRead::Differ })
    }
}

/// A file as an index records it, its strings borrowed from the bytes read.
struct FileRecord<'a> {
    path: &'a str,
    size: u64,
    mtime_ns: i64,
    etag: &'a str,
    crc32c: u32,
    chunks: ChunkCrcs,
}

impl<'a> FileRecord<'a> {
    fn read(r: &mut Reader<'a>) -> Option<Self> {
        let (path, size, mtime_ns, etag) = (r.text()?, r.u64()?, r.u64()? as i64, r.text()?);
        let crc32c = u32::try_from(r.u64()?).ok()?;
        let n = if size > CHUNK_BYTES { chunk_count(size) } else { 0 };
        let chunks = (0..n).map(|_| r.u32()).collect::<Option<ChunkCrcs>>()?;
        Some(FileRecord { path, size, mtime_ns, etag, crc32c, chunks })
    }

    /// Whether this is the file `listed` ([`ShardInfo::same_file`]).
    fn is(&self, listed: &ShardInfo) -> bool {
        *listed.path == *self.path
            && (listed.size, listed.mtime_ns) == (self.size, self.mtime_ns)
            && listed.etag == self.etag
    }
}

const MAGIC: &[u8; 8] = b"BATCHFSI";
/// The index file's layout: raised whenever what it holds is written otherwise, so that an index of
/// another layout is rebuilt whole. The rules that made what it holds are its format's
/// ([`SourceFormat::rules`]), written in it: 7 added them.
const LAYOUT: u32 = 7;
/// The layout before each format had rules of its own: its version was the rules of every format (an
/// index of it is read still, so that an upgrade past it indexes nothing again).
const LAYOUT_6: u32 = 6;

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u64(&mut self, v: u64) {
        crate::proto::put_varint(&mut self.0, v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }
    /// An ETag as [`Writer::str`] writes its text (an MD5's spelled out, not allocated).
    fn etag(&mut self, etag: &ETag) {
        use std::io::Write;
        self.u64(etag.len() as u64);
        write!(self.0, "{etag}").expect("a Vec takes every byte");
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn u8(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn u32(&mut self) -> Option<u32> {
        let (b, rest) = self.0.split_first_chunk::<4>()?;
        self.0 = rest;
        Some(u32::from_le_bytes(*b))
    }
    fn u64(&mut self) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            value |= u64::from(b & 0x7f).checked_shl(shift)?;
            if b & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }
    /// A string, borrowed from the bytes read.
    fn text(&mut self) -> Option<&'a str> {
        let len = usize::try_from(self.u64()?).ok()?;
        if len > self.0.len() {
            return None;
        }
        let (s, rest) = self.0.split_at(len);
        self.0 = rest;
        std::str::from_utf8(s).ok()
    }
    fn str(&mut self) -> Option<String> {
        self.text().map(str::to_owned)
    }
    fn list<T>(&mut self, item: impl FnMut(&mut Self) -> Option<T>) -> Option<Vec<T>> {
        let n = self.u64()?;
        self.items(n, item)
    }
    /// `n` items (a count read already).
    fn items<T>(&mut self, n: u64, mut item: impl FnMut(&mut Self) -> Option<T>) -> Option<Vec<T>> {
        let n = usize::try_from(n).ok()?;
        // Each item takes at least one byte: a corrupt count cannot make us reserve absurd memory.
        let mut out = Vec::with_capacity(n.min(self.0.len()));
        for _ in 0..n {
            out.push(item(self)?);
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The content id follows the files' contents, not their dates or ETags: an index built again of
    /// the same bytes keeps it; a file changed, added or moved changes it, as does a region left out.
    #[test]
    fn the_content_id_changes_with_the_files_and_nothing_else() {
        let file =
            |path: &str, size: u64, crc32c: u32| ShardInfo { path: path.into(), size, crc32c, ..Default::default() };
        let index = Index {
            settings: IndexSettings { format: SourceFormat::Tfrecord, verify_data_crc: false, skip_corrupt: false },
            shards: vec![file("a.tfrecord", 100, 1), file("b.tfrecord", 200, 2)],
            side: vec![file("a.tfrecord.idx", 10, 3)],
            samples: vec![],
            classes: vec![],
            skipped: vec![],
        };
        let id = index.content_id();
        let mut touched = index.clone();
        touched.shards[0].mtime_ns = 99;
        touched.shards[1].etag = ETag::new("\"x\"");
        touched.settings.verify_data_crc = true;
        touched.settings.skip_corrupt = true;
        assert_eq!(touched.content_id(), id, "dates, ETags, checking, skipping nothing: the same bytes");
        let rules = SourceFormat::Tfrecord.rules();
        assert_ne!(index.content_id_of(rules - 1), id, "a server of other rules may serve other bytes");
        let mut other = Vec::new();
        let mut changed = index.clone();
        changed.shards[1].crc32c = 5;
        other.push(changed);
        let mut added = index.clone();
        added.side.push(file("README", 1, 0));
        other.push(added);
        let mut moved = index.clone();
        moved.side = vec![];
        moved.shards.push(file("a.tfrecord.idx", 10, 3));
        other.push(moved);
        let mut skipping = index.clone();
        skipping.settings.skip_corrupt = true;
        skipping.skipped.push(Skipped { shard: "b.tfrecord".into(), offset: 40, reason: "bad CRC".into() });
        other.push(skipping);
        for o in other {
            assert_ne!(o.content_id(), id, "{o:?}");
        }
    }

    /// Indexes written by the last release of layout 6 (`batchfs-server index` of e7897f8, over `gen
    /// --samples 6 --mean-bytes 200 --shards 2 --classes 2 --seed 1` of each format), and the index id
    /// that release's server gave each: an upgrade past layout 6 takes them as they are, with the same id
    /// (no dataset indexed again, no bucket read again, no mount's reads refused).
    #[test]
    fn an_index_of_layout_6_is_taken_at_an_upgrade_with_the_id_it_had() {
        let files: [(SourceFormat, &[u8], u64); 4] = [
            (SourceFormat::Tfrecord, include_bytes!("index/testdata/tfrecord-v6.batchfs-index"), 0xcedf6659bd5aa5fa),
            (SourceFormat::Lmdb, include_bytes!("index/testdata/lmdb-v6.batchfs-index"), 0xee53f00e5679274b),
            (SourceFormat::Tar, include_bytes!("index/testdata/tar-v6.batchfs-index"), 0xe694a7cdc6186482),
            (SourceFormat::Files, include_bytes!("index/testdata/files-v6.batchfs-index"), 0xd6bb3e12139ee15c),
        ];
        for (format, bytes, id) in files {
            let index = Index::from_bytes(bytes).unwrap_or_else(|| panic!("{format}: not taken"));
            assert_eq!((index.format(), index.samples.len()), (format, 6));
            assert_eq!(index.content_id(), id, "{format}");
            assert_eq!(Index::settings_of(bytes), Some(index.settings));
            // Taken for the files listed now, as a server's start takes it.
            let as_listed = |f: &ShardInfo| ShardInfo { crc32c: 0, chunks: ChunkCrcs::default(), ..f.clone() };
            let mut listed = Listed {
                settings: index.settings,
                shards: index.shards.iter().map(as_listed).collect(),
                side: index.side.iter().map(as_listed).collect(),
            };
            assert_eq!(Index::from_bytes_listed(bytes, &mut listed).as_ref(), Ok(&index));
            // Written again in today's layout, the same index.
            let again = index.to_bytes();
            assert_eq!(again[MAGIC.len()..][..4], LAYOUT.to_le_bytes());
            assert_eq!(Index::from_bytes(&again), Some(index));
        }
    }

    /// An index made by other rules for its format is rebuilt, never taken: not loaded, not taken from
    /// as a stale index's parts; one of another layout neither. Only that format's rules count.
    #[test]
    fn an_index_of_other_rules_or_another_layout_is_refused_as_of_another_version() {
        let index = Index::from_bytes(include_bytes!("index/testdata/tar-v6.batchfs-index")).unwrap();
        let rules = index.format().rules();
        for other in [rules - 1, rules + 1] {
            let bytes = index.to_bytes_of(other);
            assert_eq!(Index::parse(&bytes, None), Err(Refused::Version), "rules {other}");
            assert_eq!(Index::settings_of(&bytes), None, "a stale index of other rules is not taken from");
            assert_ne!(index.content_id_of(other), index.content_id());
        }
        let mut bytes = index.to_bytes();
        bytes[MAGIC.len()..][..4].copy_from_slice(&(LAYOUT + 1).to_le_bytes());
        assert_eq!(Index::parse(&bytes, None), Err(Refused::Version));
        assert_eq!(Index::parse(&bytes[..MAGIC.len() + 3], None), Err(Refused::Unreadable));
    }

    fn arb_index() -> impl Strategy<Value = Index> {
        let part = ("[a-z]{0,4}", 0u32..3, 0u64..1000, 0u64..1000, any::<u32>()).prop_map(
            |(ext, shard, offset, len, crc32c)| Part { ext: ext.as_str().into(), shard, offset, len, crc32c },
        );
        let sample = ("[a-z0-9/]{0,12}", -1i64..1000, proptest::collection::vec(part, 0..3))
            .prop_map(|(key, label, parts)| Sample { key: key.into(), label, parts: parts.into() });
        (proptest::collection::vec(sample, 0..30), any::<bool>(), "[ -~]{0,20}").prop_map(|(samples, flag, reason)| {
            Index {
                settings: IndexSettings { format: SourceFormat::Tar, verify_data_crc: flag, skip_corrupt: !flag },
                shards: (0..3)
                    .map(|i| ShardInfo {
                        path: format!("s{i}.tar").into(),
                        size: 5000 + i as u64 * CHUNK_BYTES,
                        mtime_ns: -5 + i,
                        etag: match i {
                            0 => ETag::default(),
                            1 => format!("\"{reason}\"").into(),
                            _ => ETag::new("\"0123456789abcdef0123456789abcdef\""),
                        },
                        crc32c: 7,
                        chunks: (0..if i == 0 { 0 } else { chunk_count(5000 + i as u64 * CHUNK_BYTES) as u32 })
                            .collect(),
                    })
                    .collect(),
                side: vec![ShardInfo {
                    path: "s0.tar.idx".into(),
                    size: 9,
                    mtime_ns: 1,
                    crc32c: 2,
                    ..Default::default()
                }],
                samples,
                classes: vec!["cat".into(), "dog".into()],
                skipped: vec![Skipped { shard: "s1.tar".into(), offset: 77, reason }],
            }
        })
    }

    proptest! {
        #[test]
        fn roundtrip(index in arb_index()) {
            prop_assert_eq!(Index::from_bytes(&index.to_bytes()), Some(index));
        }

        /// The bytes read are the bytes written again: the compact forms in memory change nothing on disk.
        #[test]
        fn rewritten_bytes_are_the_same(index in arb_index()) {
            let bytes = index.to_bytes();
            prop_assert_eq!(Index::from_bytes(&bytes).map(|i| i.to_bytes()), Some(bytes));
        }

        /// The index persisted for the files listed now is taken with the listed files; one of other
        /// files or settings is stale, and the listing is left as it was.
        #[test]
        fn a_persisted_index_is_taken_only_for_the_files_listed(index in arb_index(), which in 0usize..6) {
            let bytes = index.to_bytes();
            let as_listed = |f: &ShardInfo| ShardInfo { crc32c: 0, chunks: ChunkCrcs::default(), ..f.clone() };
            let listing = Listed {
                settings: index.settings,
                shards: index.shards.iter().map(as_listed).collect(),
                side: index.side.iter().map(as_listed).collect(),
            };
            let mut listed = listing.clone();
            prop_assert_eq!(Index::from_bytes_listed(&bytes, &mut listed), Ok(index.clone()));
            prop_assert!(listed.shards.is_empty() && listed.side.is_empty());
            let mut changed = listing.clone();
            match which {
                0 => changed.shards[1].size += 1,
                1 => changed.shards[2].mtime_ns += 1,
                2 => changed.shards[1].etag = format!("{}x", changed.shards[1].etag).into(),
                3 => changed.side[0].path = "t0.tar.idx".into(),
                4 => changed.side.push(ShardInfo { path: "z".into(), ..Default::default() }),
                _ => changed.settings.skip_corrupt ^= true,
            }
            let mut listed = changed.clone();
            prop_assert_eq!(Index::from_bytes_listed(&bytes, &mut listed), Err(Refused::Stale));
            prop_assert_eq!(listed, changed);
            let mut listed = listing.clone();
            prop_assert_eq!(Index::from_bytes_listed(&bytes[1..], &mut listed), Err(Refused::Unreadable));
            prop_assert_eq!(listed, listing);
        }

        #[test]
        fn any_corruption_is_rejected(index in arb_index(), at: prop::sample::Index, bit in 0u8..8) {
            let mut bytes = index.to_bytes();
            let i = at.index(bytes.len());
            bytes[i] ^= 1 << bit;
            prop_assert_eq!(Index::from_bytes(&bytes), None);
        }
    }

    /// What a sample and a file cost in memory (the heap holds the key and the path beside them): a
    /// million of each are what a large file tree or bucket holds.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn samples_and_files_are_compact() {
        use std::mem::size_of;
        assert_eq!(size_of::<ETag>(), 24);
        assert_eq!((size_of::<Ext>(), size_of::<ChunkCrcs>()), (8, 8));
        assert_eq!(size_of::<Part>(), 32);
        assert_eq!(size_of::<Parts>(), 32, "a single part is held inline, without a tag of its own");
        assert_eq!(size_of::<Sample>(), 56);
        assert_eq!(size_of::<ShardInfo>(), 72);
    }

    #[test]
    fn truncated_is_rejected() {
        let index = Index {
            settings: IndexSettings { format: SourceFormat::Files, verify_data_crc: true, skip_corrupt: false },
            shards: vec![],
            side: vec![],
            samples: vec![],
            classes: vec![],
            skipped: vec![],
        };
        let bytes = index.to_bytes();
        for cut in 0..bytes.len() {
            assert_eq!(Index::from_bytes(&bytes[..cut]), None);
        }
    }
}
