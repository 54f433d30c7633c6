//! Batch encodings: how the samples of one batch become one file.
//!
//! A batch body is described by a [`BatchLayout`]: a list of [`Segment`]s (literal framing bytes, or a
//! byte range of a shard), its exact length and its CRC32C. Layouts are computed from the index alone —
//! sizes from part lengths, checksums by combining the per-part CRCs recorded at index time — so a
//! manifest costs no sample I/O, and the server streams a body straight from its mapped shards.
//!
//! Formats:
//! - `tfrecord`: TFRecord frames. Records of a TFRecord source pass through byte for byte (the whole
//!   frame is copied from the shard). Samples of other sources are wrapped as `tf.train.Example` with
//!   features `key` (bytes), `label` (int64, -1 when none) and the sample's bytes: `data` for a
//!   single-part sample, else one bytes feature per part named `data/EXT` (`data/jpg`, `data/cls`...).
//! - `tfrecord.idx`: DALI's index of that TFRecord batch: one `offset size` line per record.
//! - `tfrecord.slots`: TFRecord frames of one fixed size, the dataset's *slot* (its largest frame plus
//!   2 bytes, [`FrameSizes::slot`]): each record is the sample's Example (or stored record) followed by one
//!   padding field, field 15 of wire type 2 holding zeros, that fills the frame to the slot. Protobuf
//!   parsers skip an unknown field, so the record decodes to the same features; and record *j* of every
//!   batch of every epoch sits at `j * slot` with size `slot`, so a DALI pipeline that read the index
//!   once (at build) reads any epoch's batch of the same position. The price: every record takes the
//!   largest record's room.
//! - `tfrecord.slots.idx`: its DALI index, `j * slot slot` per record (the same for every epoch).
//! - `tar`: a POSIX (ustar + pax) tar, one member `KEY_ID.EXT` per part, then two zero blocks: the
//!   sample's key made safe and its sample id ([`tar_sample_key`]), so that WebDataset finds each sample
//!   of the batch under a key of its own even where two samples' keys are alike (`cat/a.jpg` and
//!   `cat/a.png` of a file tree are both keyed `cat/a`). Mode 0644, owner 0, mtime 0, so a body is a pure
//!   function of the samples.

use crate::crc::CrcBuilder;
use crate::index::{Index, Sample, SourceFormat};
use crate::proto::{self, Piece, WrapFeature};
use crate::{tar, tfrecord};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The file format of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum BatchFormat {
    /// TFRecord frames.
    #[default]
    #[serde(rename = "tfrecord")]
    Tfrecord,
    /// DALI's text index of the TFRecord batch.
    #[serde(rename = "tfrecord.idx")]
    TfrecordIdx,
    /// POSIX tar (WebDataset).
    #[serde(rename = "tar")]
    Tar,
    /// TFRecord frames of the dataset's fixed slot size (see the module note).
    #[serde(rename = "tfrecord.slots")]
    TfrecordSlots,
    /// DALI's index of a `tfrecord.slots` batch.
    #[serde(rename = "tfrecord.slots.idx")]
    TfrecordSlotsIdx,
}

impl BatchFormat {
    /// All formats.
    pub const ALL: [BatchFormat; 5] = [
        BatchFormat::Tfrecord,
        BatchFormat::TfrecordIdx,
        BatchFormat::Tar,
        BatchFormat::TfrecordSlots,
        BatchFormat::TfrecordSlotsIdx,
    ];

    /// Name in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            BatchFormat::Tfrecord => "tfrecord",
            BatchFormat::TfrecordIdx => "tfrecord.idx",
            BatchFormat::Tar => "tar",
            BatchFormat::TfrecordSlots => "tfrecord.slots",
            BatchFormat::TfrecordSlotsIdx => "tfrecord.slots.idx",
        }
    }

    /// The extension of batch files in this format (slots are TFRecord files all the same).
    pub fn extension(self) -> &'static str {
        match self {
            BatchFormat::Tfrecord | BatchFormat::TfrecordSlots => "tfrecord",
            BatchFormat::TfrecordIdx | BatchFormat::TfrecordSlotsIdx => "tfrecord.idx",
            BatchFormat::Tar => "tar",
        }
    }

    /// Whether this is a DALI index (of another format's batch).
    pub fn is_index(self) -> bool {
        matches!(self, BatchFormat::TfrecordIdx | BatchFormat::TfrecordSlotsIdx)
    }

    /// The format of the DALI index of this format's batches, if it has one.
    pub fn index(self) -> Option<BatchFormat> {
        match self {
            BatchFormat::Tfrecord => Some(BatchFormat::TfrecordIdx),
            BatchFormat::TfrecordSlots => Some(BatchFormat::TfrecordSlotsIdx),
            _ => None,
        }
    }

    /// The HTTP content type of a body.
    pub fn content_type(self) -> &'static str {
        match self {
            BatchFormat::Tfrecord | BatchFormat::TfrecordSlots => "application/x-tfrecord",
            BatchFormat::TfrecordIdx | BatchFormat::TfrecordSlotsIdx => "text/plain; charset=utf-8",
            BatchFormat::Tar => "application/x-tar",
        }
    }
}

impl fmt::Display for BatchFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BatchFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BatchFormat::ALL.into_iter().find(|f| f.as_str() == s).ok_or_else(|| {
            format!(
                "unknown batch format {s:?}: expected tfrecord, tfrecord.idx, tar, tfrecord.slots or \
                     tfrecord.slots.idx"
            )
        })
    }
}

/// A piece of a batch body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Literal bytes (framing, headers, padding).
    Inline(Vec<u8>),
    /// `len` bytes of shard `shard` from `offset`.
    Data { shard: u32, offset: u64, len: u64 },
}

impl Segment {
    /// Length of the segment.
    pub fn len(&self) -> u64 {
        match self {
            Segment::Inline(b) => b.len() as u64,
            Segment::Data { len, .. } => *len,
        }
    }

    /// Whether the segment is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The exact bytes of one batch body, by reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchLayout {
    pub segments: Vec<Segment>,
    /// Total length in bytes.
    pub len: u64,
    /// CRC32C of the whole body.
    pub crc32c: u32,
    /// Points of the body with the CRC32C of every byte before them: `(end, CRC32C of [0, end))`, ends
    /// increasing, at sample boundaries at least [`CHECKPOINT_BYTES`] apart (fewer in a large batch: at
    /// most [`MAX_CHECKPOINTS`] + 1), the last `(len, crc32c)`. A client checks a body's bytes as they
    /// arrive and releases each verified prefix before the rest has come. Empty for an empty body.
    pub checkpoints: Vec<(u64, u32)>,
}

/// The least distance between two [`BatchLayout::checkpoints`].
pub const CHECKPOINT_BYTES: u64 = 256 << 10;
/// Checkpoints of a body at most (plus the last), so the header that carries them stays small.
pub const MAX_CHECKPOINTS: usize = 256;

/// The least step in which a layout built by [`layout_within`] asks for memory.
pub const CHARGE_STEP: u64 = 16 << 10;

/// A layout built within a budget of memory ([`layout_within`]): the layout, or, refused, the bytes its
/// segments held when they were (what `charge` granted, its caller counted).
pub type Charged = Result<BatchLayout, u64>;

#[derive(Default)]
struct LayoutBuilder<'a> {
    segments: Vec<Segment>,
    crc: CrcBuilder,
    checkpoints: Vec<(u64, u32)>,
    /// The least distance between checkpoints ([`CHECKPOINT_BYTES`]; tests use less).
    every: u64,
    /// Only the size and checksum are wanted (a manifest): no segment is kept.
    summary: bool,
    /// Asked for the memory the segments take as they grow ([`layout_within`]).
    charge: Option<&'a mut dyn FnMut(u64) -> bool>,
    /// Heap bytes the segments hold, and bytes `charge` granted.
    held: u64,
    granted: u64,
    /// `charge` refused a step: the layout is given up.
    refused: bool,
    /// Only what the segments will hold is wanted, counted in `held` (bytes of framing) and `segments_counted`,
    /// coalesced as they would be: no checksum, no segment kept ([`layout_within`]'s first pass).
    count: bool,
    segments_counted: u64,
    /// In `count`: the last segment counted, to coalesce the next with.
    last: Counted,
}

/// The last segment a counting builder counted.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Counted {
    #[default]
    None,
    Inline,
    Data {
        shard: u32,
        end: u64,
    },
}

impl LayoutBuilder<'_> {
    fn inline(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if self.count {
            return self.count_inline(bytes.len() as u64);
        }
        self.crc.push_bytes(bytes);
        if self.summary {
            return;
        }
        if let Some(Segment::Inline(last)) = self.segments.last_mut() {
            let capacity = last.capacity();
            last.extend_from_slice(bytes);
            let grown = last.capacity() - capacity;
            self.grew(grown as u64);
        } else {
            let bytes = bytes.to_vec();
            self.grew(bytes.capacity() as u64);
            self.push(Segment::Inline(bytes));
        }
    }

    /// Counts `len` bytes of framing, in the last segment counted if that is framing too.
    fn count_inline(&mut self, len: u64) {
        self.held += len;
        if self.last != Counted::Inline {
            self.segments_counted += 1;
            self.last = Counted::Inline;
        }
    }

    fn push(&mut self, segment: Segment) {
        let capacity = self.segments.capacity();
        self.segments.push(segment);
        self.grew(((self.segments.capacity() - capacity) * std::mem::size_of::<Segment>()) as u64);
    }

    /// Counts `bytes` more of heap held, and asks `charge` for a step where what it granted is passed.
    fn grew(&mut self, bytes: u64) {
        self.held += bytes;
        if self.held <= self.granted || self.refused {
            return;
        }
        let Some(charge) = self.charge.as_mut() else { return };
        // A step, or, where that is refused, just what is held past what was granted.
        let needed = self.held - self.granted;
        match [needed.max(CHARGE_STEP), needed].into_iter().find(|&step| charge(step)) {
            Some(step) => self.granted += step,
            None => self.refused = true,
        }
    }

    /// Appends a shard range whose CRC the caller accounts for (by `crc_pieces`).
    fn data_range(&mut self, shard: u32, offset: u64, len: u64) {
        if len == 0 || self.summary {
            return;
        }
        if self.count {
            match &mut self.last {
                Counted::Data { shard: s, end } if *s == shard && *end == offset => *end += len,
                last => {
                    self.segments_counted += 1;
                    *last = Counted::Data { shard, end: offset + len };
                }
            }
            return;
        }
        // Coalesce with the previous range when contiguous in the same shard: one read instead of two.
        if let Some(Segment::Data { shard: s, offset: o, len: l }) = self.segments.last_mut() {
            if *s == shard && *o + *l == offset {
                *l += len;
                return;
            }
        }
        self.push(Segment::Data { shard, offset, len });
    }

    fn data(&mut self, shard: u32, offset: u64, len: u64, crc32c: u32) {
        if !self.count {
            self.crc.push_crc(crc32c, len);
        }
        self.data_range(shard, offset, len);
    }

    /// Marks the end of a sample: a checkpoint when the last is far enough behind.
    fn sample_end(&mut self) {
        if self.count {
            return;
        }
        let last = self.checkpoints.last().map_or(0, |c| c.0);
        if !self.summary && self.crc.len() >= last + self.every {
            self.checkpoints.push((self.crc.len(), self.crc.crc()));
        }
    }

    fn finish(mut self) -> BatchLayout {
        let (len, crc32c) = (self.crc.len(), self.crc.crc());
        let mut checkpoints = std::mem::take(&mut self.checkpoints);
        if !self.summary && len > 0 && checkpoints.last().map(|c| c.0) != Some(len) {
            checkpoints.push((len, crc32c));
        }
        BatchLayout { len, crc32c, segments: self.segments, checkpoints: thin(checkpoints, MAX_CHECKPOINTS) }
    }
}

/// At most `max` of `checkpoints` (every k-th, whose prefixes are as valid as all of them), plus the last.
fn thin(checkpoints: Vec<(u64, u32)>, max: usize) -> Vec<(u64, u32)> {
    let k = checkpoints.len().div_ceil(max.max(1));
    let Some(&last) = checkpoints.last().filter(|_| k > 1) else { return checkpoints };
    let mut kept: Vec<(u64, u32)> = checkpoints.into_iter().skip(k - 1).step_by(k).collect();
    if kept.last() != Some(&last) {
        kept.push(last);
    }
    kept
}

/// The Example a non-TFRecord sample is wrapped in, as pieces referring to the sample's parts.
pub fn example_for(sample: &Sample) -> Vec<Piece> {
    // Part features live under `data` so that no extension can collide with `key` or `label`. Several
    // parts' names (`data/jpg`, `data/cls`) are written into one string, not one each.
    let mut names = String::new();
    let mut ranges = Vec::with_capacity(sample.parts.len());
    for p in &sample.parts {
        let start = names.len();
        names.push_str("data");
        if sample.parts.len() > 1 {
            names.push('/');
            names.push_str(&p.ext);
        }
        ranges.push(start..names.len());
    }
    let mut features: Vec<(&str, WrapFeature<'_>)> = Vec::with_capacity(sample.parts.len() + 2);
    for (i, (range, p)) in ranges.into_iter().zip(&sample.parts).enumerate() {
        features.push((&names[range], WrapFeature::Part { index: i, len: p.len }));
    }
    features.push(("key", WrapFeature::Bytes(sample.key.as_bytes())));
    features.push(("label", WrapFeature::Int64(sample.label)));
    proto::example_pieces(&features)
}

/// Appends the TFRecord frame of one sample; returns the frame's size.
fn push_tfrecord(b: &mut LayoutBuilder, index: &Index, sample: &Sample) -> u64 {
    if index.format() == SourceFormat::Tfrecord {
        // Pass the stored frame through byte for byte; its header and footer are recomputed only for
        // the checksum (they are a function of the length and the stored data CRC).
        let p = &sample.parts[0];
        b.crc.push_bytes(&tfrecord::frame_header(p.len));
        b.crc.push_crc(p.crc32c, p.len);
        b.crc.push_bytes(&tfrecord::frame_footer(p.crc32c));
        b.data_range(p.shard, p.offset - tfrecord::HEADER_LEN, tfrecord::frame_len(p.len));
        return tfrecord::frame_len(p.len);
    }
    let pieces = example_for(sample);
    let example_crc = pieces_crc(sample, &pieces);
    b.inline(&tfrecord::frame_header(example_crc.len()));
    push_pieces(b, sample, &pieces);
    b.inline(&tfrecord::frame_footer(example_crc.crc()));
    tfrecord::frame_len(example_crc.len())
}

/// The CRC32C (and length) of `pieces` of `sample`, from the parts' CRCs.
fn pieces_crc(sample: &Sample, pieces: &[Piece]) -> CrcBuilder {
    let mut crc = CrcBuilder::new();
    for piece in pieces {
        match piece {
            Piece::Inline(bytes) => crc.push_bytes(bytes),
            Piece::Part { index: i, .. } => crc.push_crc(sample.parts[*i].crc32c, sample.parts[*i].len),
        }
    }
    crc
}

/// Appends `pieces` of `sample`: literal bytes, and the parts' shard ranges.
fn push_pieces(b: &mut LayoutBuilder, sample: &Sample, pieces: &[Piece]) {
    for piece in pieces {
        match piece {
            Piece::Inline(bytes) => b.inline(bytes),
            Piece::Part { index: i, .. } => {
                let p = &sample.parts[*i];
                b.data(p.shard, p.offset, p.len, p.crc32c);
            }
        }
    }
}

/// The field number and wire type (2: length-delimited) of the padding field of `tfrecord.slots` records.
const PAD_TAG: u8 = (15 << 3) | 2;
/// The smallest padding field: its tag and a zero length.
pub const MIN_PAD: u64 = 2;

/// The TFRecord frames of a dataset's samples, as `tfrecord` batches hold them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameSizes {
    /// The slot of `tfrecord.slots` batches: the largest frame plus [`MIN_PAD`].
    pub slot: u64,
    /// The mean frame (0 without samples).
    pub mean: u64,
}

/// The slot and the mean frame, in one pass over the samples (the server computes it once per
/// dataset).
pub fn frame_sizes(index: &Index) -> FrameSizes {
    let (mut max, mut total) = (0, 0u64);
    for sample in &index.samples {
        let frame = tfrecord_frame_len(index, sample);
        max = max.max(frame);
        total += frame;
    }
    FrameSizes { slot: max + MIN_PAD, mean: total.checked_div(index.samples.len() as u64).unwrap_or(0) }
}

/// A protobuf field of exactly `len` bytes (at least [`MIN_PAD`]) that parsers skip: field 15, wire type
/// 2, holding zeros. Where no length fits one field exactly (its varint growing by a byte at the
/// boundary), an empty field goes first.
pub fn pad_field(len: u64) -> Vec<u8> {
    assert!(len >= MIN_PAD, "a padding field takes at least {MIN_PAD} bytes");
    for varint in 1..=10u64 {
        let Some(body) = len.checked_sub(1 + varint) else { break };
        let mut out = vec![PAD_TAG];
        proto::put_varint(&mut out, body);
        if out.len() as u64 == 1 + varint {
            out.resize(len as usize, 0);
            return out;
        }
    }
    let mut out = vec![PAD_TAG, 0];
    out.extend(pad_field(len - 2));
    out
}

/// Appends the `tfrecord.slots` frame of one sample: its payload, then a padding field filling the frame
/// to `slot` bytes.
fn push_tfrecord_slot(b: &mut LayoutBuilder, index: &Index, sample: &Sample, slot: u64) {
    let pieces: Vec<Piece> = if index.format() == SourceFormat::Tfrecord {
        vec![Piece::Part { index: 0, len: sample.parts[0].len }]
    } else {
        example_for(sample)
    };
    let mut payload = pieces_crc(sample, &pieces);
    let pad = pad_field(slot - tfrecord::frame_len(payload.len()));
    payload.push_bytes(&pad);
    b.inline(&tfrecord::frame_header(payload.len()));
    push_pieces(b, sample, &pieces);
    b.inline(&pad);
    b.inline(&tfrecord::frame_footer(payload.crc()));
}

/// The TFRecord frame of each sample of `index`, in bytes, as `tfrecord` batches hold them.
pub fn frame_lens(index: &Index) -> Vec<u64> {
    index.samples.iter().map(|s| tfrecord_frame_len(index, s)).collect()
}

/// Size of the TFRecord frame of one sample, without building it.
fn tfrecord_frame_len(index: &Index, sample: &Sample) -> u64 {
    if index.format() == SourceFormat::Tfrecord {
        tfrecord::frame_len(sample.parts[0].len)
    } else {
        tfrecord::frame_len(example_for(sample).iter().map(Piece::len).sum())
    }
}

/// The WebDataset key of sample `id` (its number in the index), keyed `key`, in a tar batch: the key made
/// safe, then `_` and the id, so that no two samples of a batch share one. Made safe: empty, `.` and `..`
/// components are left out (an empty key becomes `sample`), control characters (a NUL ends a name for
/// tar readers) become `_`, and so does `.` in the file name, which WebDataset would take for the start of
/// the extension; a key that would start with `__`, which WebDataset skips as metadata, starts with `-_`.
/// Unique because the digits after the last `_` are the id, and a plan's batch holds a sample once.
pub fn tar_sample_key(key: &str, id: u32) -> String {
    let components: Vec<&str> = key.split('/').filter(|c| !c.is_empty() && *c != "." && *c != "..").collect();
    let mut name = String::with_capacity(key.len() + 11);
    match components.split_last() {
        Some((last, dirs)) => {
            for dir in dirs {
                name.extend(dir.chars().map(|c| if c.is_control() { '_' } else { c }));
                name.push('/');
            }
            name.extend(last.chars().map(|c| if c.is_control() || c == '.' { '_' } else { c }));
        }
        None => name.push_str("sample"),
    }
    name.push('_');
    name.push_str(&id.to_string());
    if name.starts_with("__") {
        name.replace_range(..1, "-");
    }
    name
}

/// The member name of part `ext` of the sample whose WebDataset key is `sample_key` ([`tar_sample_key`]):
/// `KEY.EXT`, control characters and `/` in the extension made `_`. A part without an extension is
/// `KEY.`, so that WebDataset, which drops a member without a `.`, keeps it (under the extension `""`).
pub fn tar_member_name(sample_key: &str, ext: &str) -> String {
    let mut name = String::with_capacity(sample_key.len() + 1 + ext.len());
    name.push_str(sample_key);
    name.push('.');
    name.extend(ext.chars().map(|c| if c.is_control() || c == '/' { '_' } else { c }));
    name
}

fn push_tar(b: &mut LayoutBuilder, sample: &Sample, id: u32) {
    // Counting, a header is at least a block (a long name takes more): counted, not made.
    let key = (!b.count).then(|| tar_sample_key(&sample.key, id));
    for p in &sample.parts {
        match &key {
            None => b.count_inline(tar::BLOCK),
            Some(key) => b.inline(&tar::file_header(&tar_member_name(key, &p.ext), p.len)),
        }
        b.data(p.shard, p.offset, p.len, p.crc32c);
        b.inline(&[0u8; tar::BLOCK as usize][..tar::padding(p.len) as usize]);
    }
}

/// The DALI index text for records of the given frame sizes.
pub fn dali_index(frame_sizes: impl IntoIterator<Item = u64>) -> Vec<u8> {
    let mut out = Vec::new();
    let mut offset = 0;
    for size in frame_sizes {
        out.extend_from_slice(format!("{offset} {size}\n").as_bytes());
        offset += size;
    }
    out
}

/// DALI's index (`tfrecord2idx`'s format) of each TFRecord shard of `index` that has none beside it
/// (no side file `<shard>.idx`): `(path, contents)`, one `offset size` line per indexed record, at the
/// record's place in the shard (a record `--skip-corrupt` left out is not listed). Empty for other
/// sources.
pub fn shard_index_twins(index: &Index) -> Vec<(String, Vec<u8>)> {
    if index.format() != SourceFormat::Tfrecord {
        return Vec::new();
    }
    let mut twins: Vec<Vec<u8>> = vec![Vec::new(); index.shards.len()];
    for part in index.samples.iter().flat_map(|s| &s.parts) {
        let offset = part.offset - tfrecord::HEADER_LEN;
        let size = part.len + tfrecord::HEADER_LEN + tfrecord::FOOTER_LEN;
        twins[part.shard as usize].extend_from_slice(format!("{offset} {size}\n").as_bytes());
    }
    let beside = |path: &str| index.side.binary_search_by(|f| f.path.as_str().cmp(path)).is_ok();
    index
        .shards
        .iter()
        .zip(twins)
        .map(|(shard, twin)| (format!("{}.idx", shard.path), twin))
        .filter(|(path, _)| !beside(path))
        .collect()
}

/// The layout of the batch made of `samples` (indices into `index.samples`), in `format`; `slot` is the
/// record size of the slots formats ([`FrameSizes::slot`] of the index), unused by the others.
pub fn layout(index: &Index, samples: &[u32], format: BatchFormat, slot: u64) -> BatchLayout {
    build(LayoutBuilder { every: CHECKPOINT_BYTES, ..LayoutBuilder::default() }, index, samples, format, slot)
}

/// [`layout`], the memory its segments take asked of `charge`: first what it will hold (its framing and
/// segments, counted by a pass that keeps nothing), then, as the segments grow past that, steps of at least
/// [`CHARGE_STEP`] bytes (the steps granted cover the heap bytes the segments hold, not the allocator's
/// own). The layout, or, at the first step refused, the bytes the segments held then with the step (the
/// layout is given up at once; the bytes granted are the caller's to give back).
/// A server bounds by it what the framing of a batch of many small samples takes (1 KB a tar member)
/// before any byte of it is sent; refused at the first step, nothing was built.
pub fn layout_within(
    index: &Index,
    samples: &[u32],
    format: BatchFormat,
    slot: u64,
    charge: &mut dyn FnMut(u64) -> bool,
) -> Charged {
    let counting = build_held(LayoutBuilder { count: true, ..LayoutBuilder::default() }, index, samples, format, slot);
    let segments = counting.2;
    let least = counting.1 + segments * std::mem::size_of::<Segment>() as u64;
    if !charge(least) {
        return Err(least);
    }
    let segments = Vec::with_capacity(usize::try_from(segments).expect("segments of a batch fit in memory"));
    let held = (segments.capacity() * std::mem::size_of::<Segment>()) as u64;
    let b = LayoutBuilder { every: CHECKPOINT_BYTES, charge: Some(charge), ..LayoutBuilder::default() };
    let b = LayoutBuilder { segments, held, granted: least, ..b };
    let (layout, held, _) = build_held(b, index, samples, format, slot);
    layout.ok_or(held)
}

/// The size and CRC32C of the batch made of `samples` (what a manifest lists), as [`layout`] computes
/// them without keeping its segments.
pub fn summary(index: &Index, samples: &[u32], format: BatchFormat, slot: u64) -> (u64, u32) {
    let summary = LayoutBuilder { summary: true, every: CHECKPOINT_BYTES, ..LayoutBuilder::default() };
    let layout = build(summary, index, samples, format, slot);
    (layout.len, layout.crc32c)
}

fn build(b: LayoutBuilder<'_>, index: &Index, samples: &[u32], format: BatchFormat, slot: u64) -> BatchLayout {
    build_held(b, index, samples, format, slot).0.expect("a layout without a budget is never refused")
}

/// The layout `b` builds, `None` where its `charge` refused a step (or it only counts), the heap bytes its
/// segments held (counted: its bytes of framing), and the segments it counted.
fn build_held(
    mut b: LayoutBuilder<'_>,
    index: &Index,
    samples: &[u32],
    format: BatchFormat,
    slot: u64,
) -> (Option<BatchLayout>, u64, u64) {
    let ids = samples;
    let samples = samples.iter().map(|&i| &index.samples[i as usize]);
    match format {
        BatchFormat::TfrecordSlots => {
            for sample in samples {
                if b.refused {
                    break;
                }
                push_tfrecord_slot(&mut b, index, sample, slot);
                b.sample_end();
            }
        }
        BatchFormat::TfrecordSlotsIdx => b.inline(&dali_index(samples.map(|_| slot))),
        BatchFormat::Tfrecord => {
            for sample in samples {
                if b.refused {
                    break;
                }
                push_tfrecord(&mut b, index, sample);
                b.sample_end();
            }
        }
        BatchFormat::TfrecordIdx => b.inline(&dali_index(samples.map(|s| tfrecord_frame_len(index, s)))),
        BatchFormat::Tar => {
            for (sample, &id) in samples.zip(ids) {
                if b.refused {
                    break;
                }
                push_tar(&mut b, sample, id);
                b.sample_end();
            }
            b.inline(&[0u8; tar::END_LEN as usize]);
        }
    }
    let (held, counted) = (b.held, b.segments_counted);
    match b.refused || b.count {
        true => (None, held, counted),
        false => (Some(b.finish()), held, counted),
    }
}

/// The data of `samples`, one after another (each sample's parts in order, nothing between them): the body
/// of a data request (`GET .../samples/data`), with checkpoints at sample ends as batches have.
pub fn data_layout(index: &Index, samples: &[u32]) -> BatchLayout {
    let mut b = LayoutBuilder { every: CHECKPOINT_BYTES, ..LayoutBuilder::default() };
    for &i in samples {
        for p in &index.samples[i as usize].parts {
            b.data(p.shard, p.offset, p.len, p.crc32c);
        }
        b.sample_end();
    }
    b.finish()
}

/// Materializes a layout, given a way to read shard ranges (tests, small tools; the server streams).
pub fn materialize(layout: &BatchLayout, mut read: impl FnMut(u32, u64, u64) -> Vec<u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(layout.len as usize);
    for seg in &layout.segments {
        match seg {
            Segment::Inline(b) => out.extend_from_slice(b),
            Segment::Data { shard, offset, len } => out.extend(read(*shard, *offset, *len)),
        }
    }
    out
}

/// The segments covering bytes `[start, end)` of a body made of `segments` (for Range requests).
pub fn slice_segments(segments: &[Segment], start: u64, end: u64) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut pos = 0u64;
    for seg in segments {
        let (seg_start, seg_end) = (pos, pos + seg.len());
        pos = seg_end;
        let (from, to) = (start.max(seg_start), end.min(seg_end));
        if from >= to {
            continue;
        }
        let (skip, take) = (from - seg_start, to - from);
        out.push(match seg {
            Segment::Inline(b) => Segment::Inline(b[skip as usize..(skip + take) as usize].to_vec()),
            Segment::Data { shard, offset, .. } => Segment::Data { shard: *shard, offset: offset + skip, len: take },
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crc;
    use crate::index::{IndexSettings, Part, ShardInfo};
    use crate::proto::FeatureValue;
    use proptest::prelude::*;

    /// A test sample: key, label, and (extension, bytes) parts.
    type TestSample = (String, i64, Vec<(String, Vec<u8>)>);

    /// An index over one in-memory "shard" holding the given samples' parts back to back.
    fn files_index(samples: &[TestSample], format: SourceFormat) -> (Index, Vec<u8>) {
        let mut shard = Vec::new();
        let mut out = Vec::new();
        for (key, label, parts) in samples {
            let mut ps = Vec::new();
            for (ext, data) in parts {
                if format == SourceFormat::Tfrecord {
                    let start = shard.len() as u64;
                    tfrecord::encode_record(data, &mut shard);
                    ps.push(Part {
                        ext: ext.as_str().into(),
                        shard: 0,
                        offset: start + 12,
                        len: data.len() as u64,
                        crc32c: crc::crc32c(data),
                    });
                } else {
                    ps.push(Part {
                        ext: ext.as_str().into(),
                        shard: 0,
                        offset: shard.len() as u64,
                        len: data.len() as u64,
                        crc32c: crc::crc32c(data),
                    });
                    shard.extend_from_slice(data);
                }
            }
            out.push(Sample { key: key.clone().into(), label: *label, parts: ps.into() });
        }
        let index = Index {
            settings: IndexSettings { format, verify_data_crc: true, skip_corrupt: false },
            shards: vec![ShardInfo { path: "s".into(), size: shard.len() as u64, ..Default::default() }],
            side: vec![],
            samples: out,
            classes: vec![],
            skipped: vec![],
        };
        (index, shard)
    }

    fn read_from(shard: &[u8]) -> impl FnMut(u32, u64, u64) -> Vec<u8> + '_ {
        move |_, o, l| shard[o as usize..(o + l) as usize].to_vec()
    }

    fn arb_samples(max_parts: usize) -> impl Strategy<Value = Vec<TestSample>> {
        proptest::collection::vec(
            (
                "[a-z0-9]{1,8}(/[a-z0-9.]{1,8})?",
                -1i64..1000,
                // Distinct extensions per sample, as WebDataset grouping gives.
                proptest::collection::btree_map(
                    "[a-z]{1,4}",
                    proptest::collection::vec(any::<u8>(), 0..700),
                    1..=max_parts,
                )
                .prop_map(|m| m.into_iter().collect::<Vec<_>>()),
            ),
            1..12,
        )
    }

    proptest! {
        #[test]
        fn tfrecord_wrapping_decodes_to_samples(samples in arb_samples(3)) {
            let (index, shard) = files_index(&samples, SourceFormat::Files);
            let order: Vec<u32> = (0..samples.len() as u32).rev().collect();
            let layout = layout(&index, &order, BatchFormat::Tfrecord, 0);
            let body = materialize(&layout, read_from(&shard));
            prop_assert_eq!(body.len() as u64, layout.len);
            prop_assert_eq!(crc::crc32c(&body), layout.crc32c);
            let records: Vec<_> = tfrecord::Scanner::new(&body, true).collect::<Result<_, _>>().unwrap();
            prop_assert_eq!(records.len(), samples.len());
            for (rec, &i) in records.iter().zip(&order) {
                let data = &body[rec.data_offset() as usize..(rec.data_offset() + rec.len) as usize];
                let (key, label, parts) = &samples[i as usize];
                let feature = |name| proto::example_feature(data, name).unwrap();
                prop_assert_eq!(feature("key"), Some(FeatureValue::Bytes(vec![key.as_bytes()])));
                prop_assert_eq!(feature("label"), Some(FeatureValue::Int64(vec![*label])));
                for (ext, bytes) in parts.iter().filter(|_| parts.len() > 1) {
                    let feature = proto::example_feature(data, &format!("data/{ext}")).unwrap();
                    prop_assert_eq!(feature, Some(FeatureValue::Bytes(vec![&bytes[..]])));
                }
                if parts.len() == 1 {
                    prop_assert_eq!(feature("data"), Some(FeatureValue::Bytes(vec![&parts[0].1[..]])));
                }
            }
            // The DALI index lists exactly these frames.
            let idx = layout_idx(&index, &order);
            let expected: String = records.iter().map(|r| format!("{} {}\n", r.frame_offset, r.frame_len())).collect();
            prop_assert_eq!(String::from_utf8(idx).unwrap(), expected);
        }

        #[test]
        fn data_layouts_are_the_samples_parts_back_to_back(
            samples in arb_samples(3),
            pick in proptest::collection::vec(0usize..12, 1..20),
        ) {
            let (index, shard) = files_index(&samples, SourceFormat::Files);
            let ids: Vec<u32> = pick.iter().map(|&i| (i % samples.len()) as u32).collect();
            let layout = data_layout(&index, &ids);
            let body = materialize(&layout, read_from(&shard));
            let parts = |i: u32| samples[i as usize].2.iter().flat_map(|(_, b)| b.clone()).collect::<Vec<u8>>();
            let expected: Vec<u8> = ids.iter().flat_map(|&i| parts(i)).collect();
            prop_assert_eq!(&body, &expected);
            prop_assert_eq!((layout.len, layout.crc32c), (body.len() as u64, crc::crc32c(&body)));
            if !body.is_empty() {
                prop_assert_eq!(layout.checkpoints.last(), Some(&(layout.len, layout.crc32c)));
            }
        }

        #[test]
        fn tfrecord_passthrough_is_byte_exact(samples in arb_samples(1)) {
            let (index, shard) = files_index(&samples, SourceFormat::Tfrecord);
            let order: Vec<u32> = (0..samples.len() as u32).collect();
            let layout = layout(&index, &order, BatchFormat::Tfrecord, 0);
            // In index order the frames are contiguous: one coalesced range for the whole batch.
            prop_assert_eq!(layout.segments.len(), 1);
            let body = materialize(&layout, read_from(&shard));
            prop_assert_eq!(&body, &shard);
            prop_assert_eq!(crc::crc32c(&body), layout.crc32c);
        }

        #[test]
        fn tar_decodes_to_samples(samples in arb_samples(3)) {
            let (index, shard) = files_index(&samples, SourceFormat::Tar);
            let order: Vec<u32> = (0..samples.len() as u32).collect();
            let layout = layout(&index, &order, BatchFormat::Tar, 0);
            let body = materialize(&layout, read_from(&shard));
            prop_assert_eq!(body.len() as u64, layout.len);
            prop_assert_eq!(body.len() % 512, 0);
            prop_assert_eq!(crc::crc32c(&body), layout.crc32c);
            let members: Vec<_> = tar::Scanner::new(&body).collect::<Result<_, _>>().unwrap();
            let expected: Vec<(String, &[u8])> = samples
                .iter()
                .enumerate()
                .flat_map(|(i, (k, _, parts))| {
                    let key = tar_sample_key(k, i as u32);
                    parts.iter().map(move |(e, d)| (tar_member_name(&key, e), &d[..]))
                })
                .collect();
            prop_assert_eq!(members.len(), expected.len());
            for (m, (name, data)) in members.iter().zip(expected) {
                prop_assert_eq!(&m.name, &name);
                prop_assert_eq!(&body[m.data_offset as usize..(m.data_offset + m.size) as usize], data);
            }
        }
    }

    /// The key WebDataset gives a tar member (its `base_plus_ext`: the path up to the first `.` of the file
    /// name), or `None` where it finds none and drops the member: no `.` in the file name, or nothing before
    /// it (stricter than WebDataset, which would take the directory for the key).
    fn webdataset_key(name: &str) -> Option<&str> {
        let base = name.rfind('/').map_or(0, |i| i + 1);
        let dot = name[base..].find('.').filter(|&d| d > 0)?;
        Some(&name[..base + dot])
    }

    /// Keys as datasets make them, hostile ones included: dots, slashes, empty components, `.`, `..`,
    /// control characters, and arbitrary bytes made UTF-8 as an LMDB key is.
    fn arb_key() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a_./]{0,6}",
            "[a\\x00\\x01\\n./_]{0,5}",
            Just(String::new()),
            Just(".".to_owned()),
            Just("..".to_owned()),
            proptest::collection::vec(any::<u8>(), 0..8).prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        ]
    }

    proptest! {
        /// However their keys look, the samples of a tar batch are exactly the samples WebDataset finds in
        /// it: each member's WebDataset key is its sample's and no other sample's, members of one sample
        /// are consecutive, and no name holds a control character (a NUL ends a name for tar readers), an
        /// empty, `.` or `..` component, or starts with `__` (WebDataset skips those as metadata).
        #[test]
        fn tar_batches_give_webdataset_one_key_per_sample(
            samples in proptest::collection::vec(
                (
                    arb_key(),
                    proptest::collection::btree_set("[a-z]{0,3}", 1..3).prop_map(|e| e.into_iter().collect::<Vec<_>>()),
                ),
                1..10,
            ),
        ) {
            let samples: Vec<TestSample> = samples
                .into_iter()
                .map(|(key, exts)| (key, -1, exts.into_iter().map(|e| (e, b"x".to_vec())).collect()))
                .collect();
            let (index, shard) = files_index(&samples, SourceFormat::Tar);
            let order: Vec<u32> = (0..samples.len() as u32).rev().collect();
            let body = materialize(&layout(&index, &order, BatchFormat::Tar, 0), read_from(&shard));
            let members: Vec<_> = tar::Scanner::new(&body).collect::<Result<_, _>>().unwrap();
            // WebDataset's grouping: consecutive members with the same key are one sample.
            let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
            for m in &members {
                prop_assert!(!m.name.chars().any(char::is_control), "{:?}", m.name);
                prop_assert!(!m.name.starts_with("__"), "{:?}", m.name);
                prop_assert!(m.name.split('/').all(|c| !c.is_empty() && c != "." && c != ".."), "{:?}", m.name);
                let key = webdataset_key(&m.name);
                prop_assert!(key.is_some(), "WebDataset drops {:?}", m.name);
                let (key, ext) = (key.unwrap(), &m.name[key.unwrap().len() + 1..]);
                match groups.last_mut() {
                    Some((k, exts)) if *k == key => exts.push(ext),
                    _ => groups.push((key, vec![ext])),
                }
            }
            let keys: std::collections::BTreeSet<&str> = groups.iter().map(|(k, _)| *k).collect();
            prop_assert_eq!(keys.len(), groups.len(), "a key names two samples: {:?}", groups);
            prop_assert_eq!(groups.len(), samples.len(), "{:?}", groups);
            for ((_, exts), &i) in groups.iter().zip(&order) {
                let want: Vec<&str> = samples[i as usize].2.iter().map(|(e, _)| e.as_str()).collect();
                prop_assert_eq!(exts, &want);
            }
        }
    }

    proptest! {
        /// Every `tfrecord.slots` frame is one slot long, passes the TFRecord checks, and its payload is
        /// the packed record's payload followed by padding that decodes as one skipped field: the
        /// Example's features are the same. Its index lists `j * slot slot`.
        #[test]
        fn slots_are_fixed_frames_that_decode_like_the_packed_records(
            samples in arb_samples(2),
            tfrecord_source: bool,
        ) {
            let source = if tfrecord_source { SourceFormat::Tfrecord } else { SourceFormat::Files };
            // A TFRecord source has one part (the record) per sample.
            let one_part = |(k, l, p): TestSample| (k, l, p[..1].to_vec());
            let samples: Vec<TestSample> =
                if tfrecord_source { samples.into_iter().map(one_part).collect() } else { samples };
            let (index, shard) = files_index(&samples, source);
            let slot = frame_sizes(&index).slot;
            let order: Vec<u32> = (0..samples.len() as u32).rev().collect();
            let packed = materialize(&layout(&index, &order, BatchFormat::Tfrecord, 0), read_from(&shard));
            let slots = layout(&index, &order, BatchFormat::TfrecordSlots, slot);
            let body = materialize(&slots, read_from(&shard));
            prop_assert_eq!((body.len() as u64, crc::crc32c(&body)), (slots.len, slots.crc32c));
            prop_assert_eq!(body.len() as u64, slot * samples.len() as u64);
            let records: Vec<_> = tfrecord::Scanner::new(&body, true).collect::<Result<_, _>>().unwrap();
            let originals: Vec<_> = tfrecord::Scanner::new(&packed, true).collect::<Result<_, _>>().unwrap();
            for (j, (rec, orig)) in records.iter().zip(&originals).enumerate() {
                prop_assert_eq!((rec.frame_offset, rec.frame_len()), (j as u64 * slot, slot));
                let data = &body[rec.data_offset() as usize..(rec.data_offset() + rec.len) as usize];
                let want = &packed[orig.data_offset() as usize..(orig.data_offset() + orig.len) as usize];
                prop_assert_eq!(&data[..want.len()], want);
                prop_assert_eq!(skip_fields(&data[want.len()..]), Some(15));
                if !tfrecord_source {
                    let (key, label, _) = &samples[order[j] as usize];
                    let feature = |name| proto::example_feature(data, name).unwrap();
                    prop_assert_eq!(feature("key"), Some(FeatureValue::Bytes(vec![key.as_bytes()])));
                    prop_assert_eq!(feature("label"), Some(FeatureValue::Int64(vec![*label])));
                }
            }
            let idx_layout = layout(&index, &order, BatchFormat::TfrecordSlotsIdx, slot);
            let idx = materialize(&idx_layout, |_, _, _| unreachable!("the index is inline"));
            let want: String = (0..samples.len() as u64).map(|j| format!("{} {slot}\n", j * slot)).collect();
            prop_assert_eq!(String::from_utf8(idx).unwrap(), want);
        }
    }

    /// The field numbers of `bytes` as protobuf fields, if they parse to the end: the padding is field 15,
    /// zeros, once or twice.
    fn skip_fields(bytes: &[u8]) -> Option<u32> {
        let fields: Vec<(u32, proto::Value)> = proto::fields(bytes).collect::<Result<_, _>>().ok()?;
        let zeros =
            fields.iter().all(|(n, v)| *n == 15 && matches!(v, proto::Value::Bytes(b) if b.iter().all(|&x| x == 0)));
        (zeros && (1..=2).contains(&fields.len())).then_some(15)
    }

    proptest! {
        /// What a manifest lists is what the body is: [`summary`] equals the full layout's size and CRC.
        #[test]
        fn summaries_match_layouts(samples in arb_samples(3), files_source: bool) {
            let source = if files_source { SourceFormat::Files } else { SourceFormat::Tar };
            let (index, _) = files_index(&samples, source);
            let order: Vec<u32> = (0..samples.len() as u32).rev().collect();
            let slot = frame_sizes(&index).slot;
            for format in BatchFormat::ALL {
                let full = layout(&index, &order, format, slot);
                prop_assert_eq!(summary(&index, &order, format, slot), (full.len, full.crc32c), "{}", format);
            }
        }
    }

    proptest! {
        /// A layout built within a budget is the layout built without one, or is refused once the memory
        /// its segments hold would pass the budget: never more granted than the budget, and every heap
        /// byte the segments hold granted.
        #[test]
        fn layouts_within_a_budget_are_the_layouts_or_refused(
            samples in arb_samples(3),
            files_source: bool,
            budget in 0u64..400_000,
        ) {
            let source = if files_source { SourceFormat::Files } else { SourceFormat::Tfrecord };
            let (index, _) = files_index(&samples, source);
            let order: Vec<u32> = (0..samples.len() as u32).rev().collect();
            let slot = frame_sizes(&index).slot;
            for format in BatchFormat::ALL {
                let mut taken = 0;
                let mut charge = |bytes| {
                    let ok = taken + bytes <= budget;
                    taken += if ok { bytes } else { 0 };
                    ok
                };
                match layout_within(&index, &order, format, slot, &mut charge) {
                    Ok(l) => {
                        prop_assert_eq!(&l, &layout(&index, &order, format, slot), "{}", format);
                        let heap = l.segments.capacity() * std::mem::size_of::<Segment>()
                            + l.segments.iter().map(|s| match s {
                                Segment::Inline(b) => b.capacity(),
                                Segment::Data { .. } => 0,
                            }).sum::<usize>();
                        prop_assert!(taken as usize >= heap, "{}: {} granted, {} held", format, taken, heap);
                        let counting = LayoutBuilder { count: true, ..LayoutBuilder::default() };
                        let (_, framing, segments) = build_held(counting, &index, &order, format, slot);
                        prop_assert_eq!(segments as usize, l.segments.len(), "{}", format);
                        let least = framing as usize + l.segments.len() * std::mem::size_of::<Segment>();
                        prop_assert!(least <= heap, "{}: {} counted ahead, {} held", format, least, heap);
                    }
                    Err(held) => {
                        prop_assert!(taken + (held - taken).max(CHARGE_STEP) > budget, "{}: refused early", format);
                    }
                }
                prop_assert!(taken <= budget);
            }
        }
    }

    proptest! {
        /// Every checkpoint is the CRC32C of the body's bytes before it, at a sample boundary (for tar: a
        /// member header follows it), at least `every` bytes after the one before, and the last is the
        /// whole body: what lets a client release a prefix before the rest has arrived.
        #[test]
        fn checkpoints_are_the_crcs_of_the_body_prefixes(
            samples in arb_samples(3),
            files_source: bool,
            every in 1u64..3_000,
        ) {
            let source = if files_source { SourceFormat::Files } else { SourceFormat::Tfrecord };
            let (index, shard) = files_index(&samples, source);
            let order: Vec<u32> = (0..samples.len() as u32).rev().collect();
            let slot = frame_sizes(&index).slot;
            for format in BatchFormat::ALL {
                let l = build(LayoutBuilder { every, ..LayoutBuilder::default() }, &index, &order, format, slot);
                let body = materialize(&l, read_from(&shard));
                prop_assert_eq!(l.checkpoints.last().copied(), Some((l.len, l.crc32c)), "{}", format);
                let mut last = 0;
                for (i, &(end, crc)) in l.checkpoints.iter().enumerate() {
                    prop_assert_eq!(crc::crc32c(&body[..end as usize]), crc, "{} at {}", format, end);
                    prop_assert!(end > last && (end >= last + every || i + 1 == l.checkpoints.len()));
                    last = end;
                }
                // (The last sample's end is followed by the end-of-archive blocks instead.)
                let first = l.checkpoints[0].0 as usize;
                if format == BatchFormat::Tar && (first as u64) + tar::END_LEN < l.len {
                    prop_assert_eq!(&body[first + 257..first + 262], b"ustar");
                }
            }
        }

        #[test]
        fn thinned_checkpoints_are_few_keep_the_last_and_are_a_subset(n in 0usize..2_000, max in 1usize..300) {
            let all: Vec<(u64, u32)> = (1..=n as u64).map(|i| (i * 10, i as u32)).collect();
            let kept = thin(all.clone(), max);
            prop_assert!(kept.len() <= max + 1);
            prop_assert_eq!(kept.last(), all.last());
            prop_assert!(kept.iter().all(|c| all.contains(c)));
            prop_assert!(kept.windows(2).all(|w| w[0].0 < w[1].0));
        }
    }

    #[test]
    fn padding_fields_are_exactly_as_long_as_asked() {
        for len in (MIN_PAD..20_000).chain([2_097_151, 2_097_152, 2_097_153, 2_097_154]) {
            let pad = pad_field(len);
            assert_eq!(pad.len() as u64, len);
            assert_eq!(skip_fields(&pad), Some(15), "{len}");
        }
    }

    proptest! {
        #[test]
        fn slices_match_the_body(samples in arb_samples(2), a in 0u64..20_000, b in 0u64..20_000) {
            let (index, shard) = files_index(&samples, SourceFormat::Files);
            let order: Vec<u32> = (0..samples.len() as u32).collect();
            let layout = layout(&index, &order, BatchFormat::Tar, 0);
            let body = materialize(&layout, read_from(&shard));
            let (start, end) = (a.min(b).min(layout.len), a.max(b).min(layout.len));
            let segments = slice_segments(&layout.segments, start, end);
            let part = BatchLayout { segments, len: end - start, crc32c: 0, checkpoints: vec![] };
            prop_assert_eq!(materialize(&part, read_from(&shard)), &body[start as usize..end as usize]);
        }
    }

    fn layout_idx(index: &Index, order: &[u32]) -> Vec<u8> {
        let l = layout(index, order, BatchFormat::TfrecordIdx, 0);
        materialize(&l, |_, _, _| unreachable!("the index is inline"))
    }

    #[test]
    fn member_names_are_safe() {
        assert_eq!(tar_member_name(&tar_sample_key("../a/./b.c", 7), "jpg"), "a/b_c_7.jpg");
        assert_eq!(tar_member_name(&tar_sample_key("", 0), "cls"), "sample_0.cls");
        assert_eq!(tar_member_name(&tar_sample_key("n01/img_1", 12), ""), "n01/img_1_12.");
        // Keys that collided before the id (`.` and `_`, `a/b` and `a//b`, `.` and `..`) no longer do.
        assert_eq!(tar_sample_key("img.1", 3), "img_1_3");
        assert_eq!(tar_sample_key("img_1", 4), "img_1_4");
        assert_eq!(tar_sample_key("a//b", 5), "a/b_5");
        assert_eq!(tar_sample_key("\u{fffd}\u{fffd}\0bin", 6), "\u{fffd}\u{fffd}_bin_6");
        assert_eq!(tar_sample_key("__meta__/x", 8), "-_meta__/x_8");
        assert_eq!(tar_sample_key("_", 9), "-_9");
        assert_eq!(tar_member_name("k_1", "a\nb/c"), "k_1.a_b_c");
    }

    #[test]
    fn formats_parse() {
        for f in BatchFormat::ALL {
            assert_eq!(f.as_str().parse::<BatchFormat>(), Ok(f));
        }
        assert!("zip".parse::<BatchFormat>().is_err());
    }
}
