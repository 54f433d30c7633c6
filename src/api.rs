//! HTTP API v1: the paths, query options, JSON types and headers that server and client share.
//!
//! | path | body |
//! |---|---|
//! | `GET /v1/datasets` | [`DatasetList`] |
//! | `GET /v1/datasets/{name}` | [`DatasetInfo`] |
//! | `GET /v1/datasets/{name}/epochs/{epoch}?{plan}` | [`Manifest`] |
//! | `GET /v1/datasets/{name}/epochs/{epoch}/batches/{i}?{plan}&format=F` | batch body (Range) |
//! | `GET /v1/datasets/{name}/files` | [`FileList`] |
//! | `GET /v1/datasets/{name}/files/{path}` | a source file (Range) |
//! | `GET /v1/datasets/{name}/rolling?{plan}&first_epoch=F&epochs=N` | [`SlotTable`] of `rolling/`'s fixed layout |
//! | `GET /v1/datasets/{name}/samples` | [`SampleTable`], binary: every sample's label, size and CRC32C |
//! | `GET /v1/datasets/{name}/samples/data?ids=I,J,...` | the samples' data, one after another (Range) |
//! | `GET /healthz`, `GET /metrics` | `ok` (503 and progress while indexing), Prometheus text |
//!
//! `{plan}` is `batch_size`, `seed`, `shuffle` (`global`, `none` or `blocks`), `drop_last` and
//! `block_bytes`, each optional with the defaults of [`PlanOptions`]. `block_bytes` is a size (`4G`,
//! `512M`, bytes; see [`crate::units::parse_size`]): with `shuffle=blocks`, the bytes of objects in use at
//! a time, 0 or absent for the server's default. [`BatchQuery::to_query`] writes it only when it is not 0,
//! so the query strings of the other modes are those of servers before it. Errors are [`ErrorBody`] JSON.
//!
//! Every reply that describes the dataset's layout says the content id of the index it was made of, as
//! [`DatasetInfo::index_id`] does: [`Manifest`], [`FileList`] and [`SlotTable`] in their `index_id`, the
//! binary [`SampleTable`] in the [`INDEX_ID_HEADER`] header.

use crate::encode::BatchFormat;
use crate::index::SourceFormat;
use crate::plan::{PlanError, PlanOptions, Shuffle};
pub use crate::rolling::SlotTable;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Header carrying the CRC32C of the whole body, 8 lowercase hex digits.
pub const CRC32C_HEADER: &str = "x-batchfs-crc32c";
/// Header carrying the number of samples in a batch.
pub const SAMPLES_HEADER: &str = "x-batchfs-samples";
/// Header of a whole batch body (200) listing its checkpoints ([`crate::encode::BatchLayout::checkpoints`]):
/// `END:CRC` pairs, comma-separated, both lowercase hex (`CRC` 8 digits), ends increasing, the last the
/// body's length and CRC32C. See [`format_checkpoints`] and [`parse_checkpoints`].
pub const CHECKPOINTS_HEADER: &str = "x-batchfs-checkpoints";
/// Header carrying the content id of the index a binary reply was made of (the sample table's; the JSON
/// replies carry theirs as a field, `index_id`), as [`DatasetInfo::index_id`] says it.
pub const INDEX_ID_HEADER: &str = "x-batchfs-index-id";
/// Header of a client's request for a body (a batch, samples' data, a file) that it asks again because the
/// same request's bytes from this server failed their checksum: the byte ranges that failed, `A-B`
/// (inclusive, decimal, of the whole body, whatever `Range` the request has), comma-separated, at most
/// [`RECHECK_SPANS`] of them. The server checks its disk tier's copies under those ranges before it answers
/// (docs/API.md). See [`format_recheck`] and [`parse_recheck`].
pub const RECHECK_HEADER: &str = "x-batchfs-recheck";
/// The most ranges one [`RECHECK_HEADER`] may name.
pub const RECHECK_SPANS: usize = 16;

/// A request that cannot be served as asked (maps to 400/404/416).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("no such path {0:?}; see GET /v1/datasets")]
    NotFound(String),
}

/// A parsed request path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Health,
    Metrics,
    Datasets,
    Dataset { name: String },
    Manifest { name: String, epoch: u64 },
    Batch { name: String, epoch: u64, batch: u64 },
    Files { name: String },
    File { name: String, path: String },
    Rolling { name: String },
    Samples { name: String },
    SampleData { name: String },
}

/// Whether `s` is a decimal number as the API writes one: ASCII digits only (`str::parse` also takes a
/// leading `+`, which made `/epochs/+1` epoch 1).
fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

fn number(what: &str, s: &str) -> Result<u64, ApiError> {
    if !is_digits(s) {
        return Err(ApiError::BadRequest(format!("{what} must be a non-negative integer, got {s:?}")));
    }
    s.parse().map_err(|e: std::num::ParseIntError| match e.kind() {
        // Digits, too many of them: said so, not "must be a non-negative integer".
        std::num::IntErrorKind::PosOverflow => {
            ApiError::BadRequest(format!("{what} is too large: at most {}, got {s}", u64::MAX))
        }
        _ => ApiError::BadRequest(format!("{what} must be a non-negative integer, got {s:?}")),
    })
}

/// Decodes `%XX` escapes (two hex digits); `None` for malformed escapes or invalid UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            // Hex digits only: `u8::from_str_radix` also takes a sign (`%+5` was byte 5).
            let hex = s.get(i + 1..i + 3).filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Encodes everything but unreserved characters and `/`.
pub fn percent_encode_path(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Route {
    /// Parses a request path (without the query).
    pub fn parse(path: &str) -> Result<Route, ApiError> {
        let not_found = || ApiError::NotFound(path.to_owned());
        match path {
            "/healthz" => return Ok(Route::Health),
            "/metrics" => return Ok(Route::Metrics),
            "/v1/datasets" | "/v1/datasets/" => return Ok(Route::Datasets),
            _ => {}
        }
        let rest = path.strip_prefix("/v1/datasets/").ok_or_else(not_found)?;
        let (raw_name, rest) = rest.split_once('/').unwrap_or((rest, ""));
        let name = percent_decode(raw_name).filter(|n| !n.is_empty()).ok_or_else(not_found)?;
        if rest.is_empty() {
            return Ok(Route::Dataset { name });
        }
        if rest == "files" || rest == "files/" {
            return Ok(Route::Files { name });
        }
        if rest == "rolling" {
            return Ok(Route::Rolling { name });
        }
        if rest == "samples" {
            return Ok(Route::Samples { name });
        }
        if rest == "samples/data" {
            return Ok(Route::SampleData { name });
        }
        if let Some(file) = rest.strip_prefix("files/") {
            let path = percent_decode(file)
                .ok_or_else(|| ApiError::BadRequest(format!("malformed percent-encoding in {file:?}")))?;
            return Ok(Route::File { name, path });
        }
        let segments: Vec<&str> = rest.split('/').collect();
        match segments.as_slice() {
            ["epochs", e] => Ok(Route::Manifest { name, epoch: number("epoch", e)? }),
            ["epochs", e, "batches", b] => {
                Ok(Route::Batch { name, epoch: number("epoch", e)?, batch: number("batch", b)? })
            }
            _ => Err(not_found()),
        }
    }
}

/// Path of a dataset's description.
pub fn dataset_path(name: &str) -> String {
    format!("/v1/datasets/{}", percent_encode_path(name).replace('/', "%2F"))
}

/// Path of an epoch's manifest.
pub fn manifest_path(name: &str, epoch: u64) -> String {
    format!("{}/epochs/{epoch}", dataset_path(name))
}

/// Path of one batch.
pub fn batch_path(name: &str, epoch: u64, batch: u64) -> String {
    format!("{}/batches/{batch}", manifest_path(name, epoch))
}

/// Path of the list of source files.
pub fn files_path(name: &str) -> String {
    format!("{}/files", dataset_path(name))
}

/// Path of one source file.
pub fn file_path(name: &str, path: &str) -> String {
    format!("{}/files/{}", dataset_path(name), percent_encode_path(path))
}

/// Path of the slot table of `rolling/`'s fixed layout.
pub fn rolling_path(name: &str) -> String {
    format!("{}/rolling", dataset_path(name))
}

/// Path of the sample table.
pub fn samples_path(name: &str) -> String {
    format!("{}/samples", dataset_path(name))
}

/// Path of samples' data (`?ids=` names them).
pub fn sample_data_path(name: &str) -> String {
    format!("{}/samples/data", dataset_path(name))
}

/// Samples one data request may name at most.
pub const MAX_SAMPLE_IDS: usize = 1024;

/// Parses the query of a data request: `ids=I,J,...`, decimal sample ids (1 to [`MAX_SAMPLE_IDS`] of
/// them, repeats allowed), each below `samples`.
pub fn parse_sample_ids(query: &str, samples: u64) -> Result<Vec<u32>, ApiError> {
    let bad = |msg: String| ApiError::BadRequest(msg);
    let mut ids = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("ids", list)) if ids.is_none() => ids = Some(list),
            Some(("ids", _)) => return Err(bad("query parameter ids given twice".into())),
            _ => return Err(bad(format!("unknown query parameter {pair:?}; expected ids=I,J,..."))),
        }
    }
    let list = ids.ok_or_else(|| bad("ids=I,J,... is required".into()))?;
    let ids: Vec<u32> = list
        .split(',')
        .map(|i| {
            let id = number("a sample id", i)?;
            if id >= samples {
                return Err(bad(format!("sample {id} does not exist (the dataset has {samples})")));
            }
            Ok(id as u32)
        })
        .collect::<Result<_, _>>()?;
    if ids.len() > MAX_SAMPLE_IDS {
        return Err(bad(format!("{} sample ids; one request names {MAX_SAMPLE_IDS} at most", ids.len())));
    }
    Ok(ids)
}

/// The query of a data request for `ids`.
pub fn sample_ids_query(ids: &[u32]) -> String {
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    format!("ids={}", list.join(","))
}

/// Every sample of a dataset, by id: its label, the bytes of its data (its parts one after another, as a
/// data request sends them) and their CRC32C. Sent binary, [`SampleTable::RECORD`] bytes per sample, little
/// endian: the label as u32 (`u32::MAX`: none), the CRC32C as u32, the size as u64. A mount's `shuffled/`
/// view is made of it: ~20 MB for ImageNet's 1.28 M samples, once per mount.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SampleTable {
    pub labels: Vec<u32>,
    pub crc32c: Vec<u32>,
    pub bytes: Vec<u64>,
    /// The content id of the index the table was made of (as [`DatasetInfo::index_id`]; empty: not said).
    /// No part of the encoding, which stays 16 bytes a sample: the server sends it in [`INDEX_ID_HEADER`].
    pub index_id: String,
}

impl SampleTable {
    /// Bytes per sample in the encoding.
    pub const RECORD: usize = 16;
    /// The label of a sample that has none.
    pub const NO_LABEL: u32 = u32::MAX;

    /// How many samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The binary encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len() * Self::RECORD);
        for i in 0..self.len() {
            out.extend_from_slice(&self.labels[i].to_le_bytes());
            out.extend_from_slice(&self.crc32c[i].to_le_bytes());
            out.extend_from_slice(&self.bytes[i].to_le_bytes());
        }
        out
    }

    /// Decodes [`SampleTable::encode`]'s bytes (no index id: the reply's header has it); `None` unless they
    /// are whole records.
    pub fn decode(data: &[u8]) -> Option<SampleTable> {
        if !data.len().is_multiple_of(Self::RECORD) {
            return None;
        }
        let n = data.len() / Self::RECORD;
        let mut t = SampleTable {
            labels: Vec::with_capacity(n),
            crc32c: Vec::with_capacity(n),
            bytes: Vec::with_capacity(n),
            index_id: String::new(),
        };
        for r in data.chunks_exact(Self::RECORD) {
            t.labels.push(u32::from_le_bytes(r[0..4].try_into().ok()?));
            t.crc32c.push(u32::from_le_bytes(r[4..8].try_into().ok()?));
            t.bytes.push(u64::from_le_bytes(r[8..16].try_into().ok()?));
        }
        Some(t)
    }
}

/// The query of manifest and batch requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BatchQuery {
    pub plan: PlanOptions,
    pub format: BatchFormat,
}

/// The keys [`BatchQuery::set`] takes.
pub const QUERY_KEYS: &str = "batch_size, seed, shuffle, drop_last, block_bytes, format";

impl BatchQuery {
    /// Parses `batch_size=..&seed=..&shuffle=..&drop_last=..&block_bytes=..&format=..` (all optional, each as
    /// [`BatchQuery::set`] takes it). Unknown or repeated keys and bad values are errors that say what is
    /// allowed.
    pub fn parse(query: &str) -> Result<BatchQuery, ApiError> {
        let mut q = BatchQuery::default();
        let mut seen = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let bad = |msg: String| ApiError::BadRequest(msg);
            let (key, value) = match pair.split_once('=') {
                Some((key, value)) => {
                    let decoded = percent_decode(&value.replace('+', " "));
                    (key, Some(decoded.ok_or_else(|| bad(format!("malformed value for {key}")))?))
                }
                None => (pair, None),
            };
            if seen.contains(&key) {
                return Err(bad(format!("query parameter {key} given twice")));
            }
            seen.push(key);
            if !q.set(key, value.as_deref())? {
                return Err(bad(format!("unknown query parameter {key:?}; expected {QUERY_KEYS}")));
            }
        }
        Ok(q)
    }

    /// Applies one plan option or the batch format, given as text: the one parser of `batch_size`,
    /// `seed`, `shuffle`, `drop_last`, `block_bytes` and `format`, for the server's query strings and the
    /// mount's options alike. `value` is `None` for a bare key: `drop_last` alone means true. Booleans are
    /// `true`/`1`/`yes` or `false`/`0`/`no`; `block_bytes` is a size as [`crate::units::parse_size`] reads
    /// it (`4G`). Returns false, changing nothing, for any other key.
    pub fn set(&mut self, key: &str, value: Option<&str>) -> Result<bool, ApiError> {
        let bad = |msg: String| ApiError::BadRequest(msg);
        let need = || value.ok_or_else(|| bad(format!("{key} needs a value ({key}=...)")));
        match key {
            "batch_size" => {
                let text = need()?;
                let n = number(key, text).map_err(|e| {
                    match !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
                        // Beyond any integer, as out of range as one beyond the plan's largest batch.
                        true => {
                            bad(format!("batch_size must be between 1 and {}, got {text}", crate::plan::MAX_BATCH_SIZE))
                        }
                        false => e,
                    }
                })?;
                let mut plan = self.plan;
                plan.batch_size = u32::try_from(n).map_err(|_| bad(PlanError::BadBatchSize(n).to_string()))?;
                plan.validate().map_err(|e| bad(e.to_string()))?;
                self.plan = plan;
            }
            "seed" => self.plan.seed = number(key, need()?)?,
            "shuffle" => self.plan.shuffle = need()?.parse::<Shuffle>().map_err(|e| bad(e.to_string()))?,
            "drop_last" => {
                self.plan.drop_last = match value {
                    None => true,
                    Some(v) => crate::units::parse_switch(v).map_err(|e| bad(format!("drop_last: {e}")))?,
                }
            }
            "block_bytes" => {
                let value = need()?;
                self.plan.block_bytes = crate::units::parse_size(value)
                    .map_err(|e| bad(format!("block_bytes must be a size such as 4G or 512M: {e}")))?;
            }
            "format" => self.format = need()?.parse().map_err(bad)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The canonical query string: every key in a fixed order, but `block_bytes` only when it is not 0
    /// (in bytes), so that a query without it reads as before the key existed.
    pub fn to_query(&self) -> String {
        let block_bytes = match self.plan.block_bytes {
            0 => String::new(),
            n => format!("&block_bytes={n}"),
        };
        format!(
            "batch_size={}&seed={}&shuffle={}&drop_last={}{block_bytes}&format={}",
            self.plan.batch_size, self.plan.seed, self.plan.shuffle, self.plan.drop_last, self.format
        )
    }
}

/// The query of a slot table: the plan options, and the span of epochs (`first_epoch`, default 0, and
/// `epochs`, required) whose TFRecord batches the slots must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RollingQuery {
    pub plan: PlanOptions,
    pub first_epoch: u64,
    pub epochs: u64,
}

impl RollingQuery {
    /// Parses `{plan}&first_epoch=F&epochs=N` (`format`, if given, must be `tfrecord`: the slots hold
    /// TFRecord frames).
    pub fn parse(query: &str) -> Result<RollingQuery, ApiError> {
        let bad = |msg: String| ApiError::BadRequest(msg);
        let (mut first_epoch, mut epochs) = (None, None);
        let mut plan = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let slot = match key {
                "first_epoch" => &mut first_epoch,
                "epochs" => &mut epochs,
                _ => {
                    plan.push(pair);
                    continue;
                }
            };
            if slot.replace(number(key, value)?).is_some() {
                return Err(bad(format!("query parameter {key} given twice")));
            }
        }
        let plan = BatchQuery::parse(&plan.join("&"))?;
        if plan.format != BatchFormat::Tfrecord {
            return Err(bad(format!("slot tables hold TFRecord frames: format={} is not one", plan.format)));
        }
        let epochs = epochs.ok_or_else(|| bad("epochs=N is required (the epochs the slots must hold)".into()))?;
        Ok(RollingQuery { plan: plan.plan, first_epoch: first_epoch.unwrap_or(0), epochs })
    }

    /// The canonical query string.
    pub fn to_query(&self) -> String {
        let plan = BatchQuery { plan: self.plan, format: BatchFormat::Tfrecord };
        format!("{}&first_epoch={}&epochs={}", plan.to_query(), self.first_epoch, self.epochs)
    }
}

/// A dataset as the server describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetInfo {
    pub name: String,
    pub format: SourceFormat,
    pub samples: u64,
    /// Bytes of sample data.
    pub bytes: u64,
    pub shards: u64,
    /// Class names (file trees), empty where labels are bare numbers.
    pub classes: Vec<String>,
    /// Corrupt regions skipped while indexing.
    pub skipped: u64,
    /// The record size of `tfrecord.slots` batches (the largest TFRecord frame plus 2 bytes).
    #[serde(default)]
    pub slot_bytes: u64,
    /// The mean TFRecord frame, in bytes (what a record of a `tfrecord` batch takes on average).
    #[serde(default)]
    pub mean_frame_bytes: u64,
    /// How the server reads the shards: `mmap`, `direct` or `pread` (empty from servers before it said).
    #[serde(default)]
    pub io: String,
    /// Bytes of the shards of a direct dataset held in the server's memory (the `resident` limit).
    #[serde(default)]
    pub resident_bytes: u64,
    /// The index's content id (`Index::content_id`, 16 hex digits; empty from servers before it said):
    /// another means the dataset was indexed again with other files since.
    #[serde(default)]
    pub index_id: String,
}

/// `GET /v1/datasets`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetList {
    pub datasets: Vec<DatasetInfo>,
}

/// One batch in a manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchEntry {
    pub index: u64,
    pub samples: u32,
    pub bytes: u64,
    pub crc32c: u32,
}

/// `GET /v1/datasets/{name}/epochs/{epoch}`: every batch of the epoch with its size and checksum.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub dataset: String,
    pub epoch: u64,
    pub options: PlanOptions,
    pub format: BatchFormat,
    /// Samples in the epoch (after `drop_last`).
    pub samples: u64,
    /// Bytes of all batch bodies.
    pub bytes: u64,
    pub batches: Vec<BatchEntry>,
    /// The content id of the index the plan was made of (as [`DatasetInfo::index_id`]).
    #[serde(default)]
    pub index_id: String,
}

/// One source file of a dataset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the dataset root, `/`-separated.
    pub path: String,
    pub size: u64,
    /// CRC32C of the whole file, from the index.
    pub crc32c: u32,
    /// CRC32C of each `chunk_bytes` chunk of the file, in order, when it is larger than one chunk
    /// (absent otherwise: the one chunk's CRC is `crc32c`). A client reading ranges checks each chunk.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<u32>,
    /// In a file tree, the id of the sample the file is (its data is the file; see [`SampleTable`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample: Option<u32>,
}

/// `GET /v1/datasets/{name}/files?dir=DIR&cursor=N&limit=N`: one page of directory `dir` of the
/// dataset (`""`: the top), whose files are the shards, the files beside them, and a DALI index
/// (`<shard>.idx`) for each TFRecord shard that has none. Entries come in path order; a directory of
/// any size is listed in pages, never one document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileList {
    /// The chunk size of [`FileEntry::chunks`].
    #[serde(default = "default_chunk_bytes")]
    pub chunk_bytes: u64,
    /// The directory listed.
    #[serde(default)]
    pub dir: String,
    /// Names of its subdirectories on this page.
    #[serde(default)]
    pub dirs: Vec<String>,
    /// Its files on this page.
    pub files: Vec<FileEntry>,
    /// Where the next page starts (`cursor=`), if there is one (absent on the last page, as the API says:
    /// it was `null`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<u64>,
    /// The content id of the index the page was listed from (as [`DatasetInfo::index_id`]; empty from
    /// servers before it said).
    #[serde(default)]
    pub index_id: String,
}

/// The query of a file-list page.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FilesQuery {
    /// The directory, `/`-separated, without leading or trailing `/` (`""`: the top).
    pub dir: String,
    /// Where to start: 0, or a page's `next`.
    pub cursor: u64,
    /// Entries (files and subdirectories) at most; 0: [`FILES_PAGE`].
    pub limit: usize,
}

/// Entries of a file-list page by default, and at most.
pub const FILES_PAGE: usize = 10_000;
pub const FILES_PAGE_MAX: usize = 100_000;

impl FilesQuery {
    /// Parses `dir`, `cursor` and `limit` (each at most once; `limit` is capped at [`FILES_PAGE_MAX`]).
    pub fn parse(query: &str) -> Result<FilesQuery, ApiError> {
        let bad = |msg: String| ApiError::BadRequest(msg);
        let mut q = FilesQuery::default();
        let mut seen = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| bad(format!("{pair} needs a value")))?;
            let value = percent_decode(&value.replace('+', " ")).ok_or_else(|| bad(format!("malformed {key}")))?;
            if seen.contains(&key) {
                return Err(bad(format!("query parameter {key} given twice")));
            }
            seen.push(key);
            match key {
                "dir" => {
                    let dir = value.trim_matches('/');
                    if dir.split('/').any(|c| c == ".." || c == ".") {
                        return Err(bad(format!("dir={value:?}: no . or .. components")));
                    }
                    q.dir = dir.to_owned();
                }
                "cursor" => q.cursor = number(key, &value)?,
                "limit" => q.limit = (number(key, &value)? as usize).min(FILES_PAGE_MAX),
                _ => return Err(bad(format!("unknown query parameter {key:?}; expected dir, cursor or limit"))),
            }
        }
        Ok(q)
    }

    /// The query string.
    pub fn to_query(&self) -> String {
        let mut out = format!("dir={}&cursor={}", percent_encode_path(&self.dir), self.cursor);
        if self.limit > 0 {
            out.push_str(&format!("&limit={}", self.limit));
        }
        out
    }

    /// The page size asked for.
    pub fn page(&self) -> usize {
        if self.limit == 0 {
            FILES_PAGE
        } else {
            self.limit
        }
    }
}

fn default_chunk_bytes() -> u64 {
    crate::index::CHUNK_BYTES
}

/// The body of every error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

/// A parsed `Range` header against a body of known length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeRequest {
    /// Serve the whole body (no header, or a form we choose to ignore, such as several ranges).
    Full,
    /// Serve `[start, end)`.
    Partial { start: u64, end: u64 },
    /// 416: nothing of the body satisfies the range.
    Unsatisfiable,
}

/// Parses a `Range` header value for a body of `len` bytes. Only single `bytes=` ranges are honoured;
/// anything else is ignored (the full body is sent, as RFC 9110 allows).
pub fn parse_range(header: Option<&str>, len: u64) -> RangeRequest {
    let Some(spec) = header.and_then(|h| h.trim().strip_prefix("bytes=")) else {
        return RangeRequest::Full;
    };
    if spec.contains(',') {
        return RangeRequest::Full;
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return RangeRequest::Full;
    };
    let (a, b) = (a.trim(), b.trim());
    // Digits only; more of them than a u64 holds is a position past any body (RFC 9110 has no bound):
    // `bytes=0-99999999999999999999` is to the end, `bytes=99999999999999999999-` unsatisfiable.
    let parse = |s: &str| is_digits(s).then(|| s.parse::<u64>().unwrap_or(u64::MAX));
    match (a.is_empty(), b.is_empty()) {
        (true, false) => match parse(b) {
            Some(0) => RangeRequest::Unsatisfiable,
            Some(n) if len > 0 => RangeRequest::Partial { start: len.saturating_sub(n), end: len },
            Some(_) => RangeRequest::Unsatisfiable,
            None => RangeRequest::Full,
        },
        (false, _) => {
            let Some(start) = parse(a) else {
                return RangeRequest::Full;
            };
            let end = if b.is_empty() {
                len
            } else {
                match parse(b) {
                    Some(last) if last >= start => last.saturating_add(1).min(len),
                    _ => return RangeRequest::Full,
                }
            };
            if start >= len {
                RangeRequest::Unsatisfiable
            } else {
                RangeRequest::Partial { start, end }
            }
        }
        (true, true) => RangeRequest::Full,
    }
}

/// The value of [`RECHECK_HEADER`] for the byte ranges `spans` (`[start, end)` each, non-empty).
pub fn format_recheck(spans: &[(u64, u64)]) -> String {
    let spans: Vec<String> = spans.iter().map(|(start, end)| format!("{start}-{}", end - 1)).collect();
    spans.join(",")
}

/// Parses a [`RECHECK_HEADER`] value against a body of `len` bytes: its ranges as `[start, end)`. A
/// `BadRequest` saying why where it is not 1 to [`RECHECK_SPANS`] ranges `A-B` of digits with `A <= B < len`.
pub fn parse_recheck(value: &str, len: u64) -> Result<Vec<(u64, u64)>, ApiError> {
    let bad = |why: String| ApiError::BadRequest(format!("{RECHECK_HEADER} {value:?}: {why}"));
    let mut out = Vec::new();
    for span in value.split(',') {
        let (a, b) = span.trim().split_once('-').ok_or_else(|| bad(format!("{span:?} is not A-B")))?;
        let number = |s: &str| (is_digits(s)).then(|| s.parse::<u64>().ok()).flatten();
        let (Some(a), Some(b)) = (number(a.trim()), number(b.trim())) else {
            return Err(bad(format!("{span:?} is not two byte offsets A-B")));
        };
        if a > b || b >= len {
            return Err(bad(format!("{span:?} is not a range of the body's {len} bytes")));
        }
        out.push((a, b + 1));
    }
    if out.len() > RECHECK_SPANS {
        return Err(bad(format!("{} ranges, at most {RECHECK_SPANS}", out.len())));
    }
    Ok(out)
}

/// The value of [`CHECKPOINTS_HEADER`] for `checkpoints`.
pub fn format_checkpoints(checkpoints: &[(u64, u32)]) -> String {
    let pairs: Vec<String> = checkpoints.iter().map(|(end, crc)| format!("{end:x}:{crc:08x}")).collect();
    pairs.join(",")
}

/// Parses a [`CHECKPOINTS_HEADER`] value: `None` unless it is a non-empty list of `END:CRC` pairs with
/// ends strictly increasing and above zero.
pub fn parse_checkpoints(value: &str) -> Option<Vec<(u64, u32)>> {
    fn hex(s: &str, digits: usize) -> Option<u64> {
        let ok = !s.is_empty() && s.len() <= digits && s.bytes().all(|b| b.is_ascii_hexdigit());
        ok.then(|| u64::from_str_radix(s, 16).ok()).flatten()
    }
    let mut out: Vec<(u64, u32)> = Vec::new();
    for pair in value.split(',') {
        let (end, crc) = pair.trim().split_once(':')?;
        let (end, crc) = (hex(end, 16)?, hex(crc, 8)? as u32);
        if end <= out.last().map_or(0, |c| c.0) {
            return None;
        }
        out.push((end, crc));
    }
    Some(out)
}

/// A strong ETag for a body with this checksum and length.
pub fn etag(crc32c: u32, len: u64) -> String {
    format!("\"{crc32c:08x}-{len:x}\"")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A recheck names ranges of the body, and nothing outside it: a range past the body's end, reversed,
    /// not digits or one too many is a `BadRequest` naming the header.
    #[test]
    fn a_recheck_names_ranges_within_the_body_and_reads_back() {
        let spans = [(0, 1), (10, 4096), (4096, 5000)];
        assert_eq!(format_recheck(&spans), "0-0,10-4095,4096-4999");
        assert_eq!(parse_recheck(&format_recheck(&spans), 5000), Ok(spans.to_vec()));
        assert_eq!(parse_recheck(" 7 - 9 ", 10), Ok(vec![(7, 10)]));
        let many = vec!["0-0"; RECHECK_SPANS + 1].join(",");
        for bad in ["", "5", "0-5000", "9-3", "a-b", "-1-2", "+1-2", "0-99999999999999999999", &many] {
            let e = parse_recheck(bad, 5000).unwrap_err();
            assert!(matches!(&e, ApiError::BadRequest(m) if m.contains(RECHECK_HEADER)), "{bad}: {e}");
        }
        assert!(parse_recheck("0-0", 0).is_err(), "an empty body has no range");
    }

    /// The last page of a listing has no `next` (the API says absent; it was `null`), and reads back.
    #[test]
    fn the_last_page_of_a_listing_has_no_next() {
        let page = FileList {
            chunk_bytes: 4096,
            dir: String::new(),
            dirs: vec![],
            files: vec![],
            next: None,
            index_id: "5f1c0a9e33d2b871".into(),
        };
        let json = serde_json::to_string(&page).unwrap();
        assert!(!json.contains("next"), "{json}");
        assert_eq!(serde_json::from_str::<FileList>(&json).unwrap(), page);
        let more = FileList { next: Some(7), ..page };
        assert!(serde_json::to_string(&more).unwrap().contains(r#""next":7,"#));
    }

    /// A page, a slot table and a description of a server before index ids read with none (empty: not
    /// checked), and a sample table's id is no part of its bytes.
    #[test]
    fn replies_of_servers_before_index_ids_read_with_none() {
        let page: FileList = serde_json::from_str(r#"{"chunk_bytes":4096,"dir":"","dirs":[],"files":[]}"#).unwrap();
        assert_eq!(page.index_id, "");
        let slots = r#"{"options":{"batch_size":2,"seed":0,"shuffle":"global","drop_last":false},"first_epoch":0,"#;
        let table: SlotTable = serde_json::from_str(&format!(r#"{slots}"epochs":1,"batches":[[3,2]]}}"#)).unwrap();
        assert_eq!((table.index_id.as_str(), table.batches.as_slice()), ("", &[vec![3, 2]][..]));
        let samples = SampleTable { labels: vec![1], crc32c: vec![2], bytes: vec![3], index_id: "ab".into() };
        assert_eq!(samples.encode().len(), SampleTable::RECORD, "16 bytes a sample, the id in a header");
        assert_eq!(SampleTable::decode(&samples.encode()), Some(SampleTable { index_id: String::new(), ..samples }));
    }

    proptest! {
        #[test]
        fn checkpoints_round_trip(ends in proptest::collection::btree_set(1u64.., 1..300), crc: u32) {
            let cps: Vec<(u64, u32)> = ends.into_iter().map(|e| (e, crc ^ e as u32)).collect();
            prop_assert_eq!(parse_checkpoints(&format_checkpoints(&cps)), Some(cps));
        }

        #[test]
        fn sample_tables_round_trip(
            records in proptest::collection::vec((any::<u32>(), any::<u32>(), any::<u64>()), 0..200),
        ) {
            let t = SampleTable {
                labels: records.iter().map(|r| r.0).collect(),
                crc32c: records.iter().map(|r| r.1).collect(),
                bytes: records.iter().map(|r| r.2).collect(),
                index_id: String::new(),
            };
            let data = t.encode();
            prop_assert_eq!(data.len(), records.len() * SampleTable::RECORD);
            prop_assert_eq!(SampleTable::decode(&data), Some(t));
            if !data.is_empty() {
                prop_assert_eq!(SampleTable::decode(&data[1..]), None);
            }
        }

        #[test]
        fn sample_id_queries_round_trip(ids in proptest::collection::vec(0u32..1000, 1..MAX_SAMPLE_IDS)) {
            prop_assert_eq!(parse_sample_ids(&sample_ids_query(&ids), 1000), Ok(ids));
        }

        #[test]
        fn checkpoint_headers_never_panic(value in "[0-9a-fA-F:, x+-]{0,80}") {
            if let Some(cps) = parse_checkpoints(&value) {
                prop_assert!(!cps.is_empty() && cps[0].0 > 0 && cps.windows(2).all(|w| w[0].0 < w[1].0));
            }
        }
    }

    #[test]
    fn malformed_checkpoints_are_refused() {
        for bad in ["", "10", "10:", ":1", "10:1,10:2", "0:1", "20:1,10:2", "10:123456789", "g:1", "10:+1", "-1:0"] {
            assert_eq!(parse_checkpoints(bad), None, "{bad:?}");
        }
        assert_eq!(parse_checkpoints("400:0000abcd, 800:ffffffff"), Some(vec![(0x400, 0xabcd), (0x800, u32::MAX)]));
    }

    #[test]
    fn sample_ids_are_checked() {
        assert_eq!(parse_sample_ids("ids=3,0,3", 4), Ok(vec![3, 0, 3]));
        let too_many = sample_ids_query(&vec![0; MAX_SAMPLE_IDS + 1]);
        for bad in ["", "ids=", "ids=4", "ids=1,,2", "ids=-1", "ids=1&ids=2", "id=1", "ids=1&x=2", &too_many] {
            assert!(matches!(parse_sample_ids(bad, 4), Err(ApiError::BadRequest(_))), "{bad:?}");
        }
        assert_eq!(Route::parse("/v1/datasets/a/samples"), Ok(Route::Samples { name: "a".into() }));
        assert_eq!(Route::parse("/v1/datasets/a/samples/data"), Ok(Route::SampleData { name: "a".into() }));
    }

    #[test]
    fn routes() {
        assert_eq!(Route::parse("/healthz"), Ok(Route::Health));
        assert_eq!(Route::parse("/v1/datasets/img%20net"), Ok(Route::Dataset { name: "img net".into() }));
        assert_eq!(Route::parse("/v1/datasets/a/epochs/3"), Ok(Route::Manifest { name: "a".into(), epoch: 3 }));
        assert_eq!(
            Route::parse("/v1/datasets/a/epochs/3/batches/7"),
            Ok(Route::Batch { name: "a".into(), epoch: 3, batch: 7 })
        );
        assert_eq!(
            Route::parse("/v1/datasets/a/files/x/y%2Ejpg"),
            Ok(Route::File { name: "a".into(), path: "x/y.jpg".into() })
        );
        assert!(matches!(Route::parse("/v1/datasets/a/epochs/x"), Err(ApiError::BadRequest(_))));
        assert!(matches!(Route::parse("/v2"), Err(ApiError::NotFound(_))));
        assert!(matches!(Route::parse("/v1/datasets/a/epochs/1/batches/2/x"), Err(ApiError::NotFound(_))));
        assert_eq!(Route::parse(&rolling_path("a b")), Ok(Route::Rolling { name: "a b".into() }));
    }

    #[test]
    fn rolling_queries() {
        let q = RollingQuery::parse("batch_size=64&first_epoch=3&epochs=10&seed=2").unwrap();
        assert_eq!((q.plan.batch_size, q.plan.seed, q.first_epoch, q.epochs), (64, 2, 3, 10));
        assert_eq!(RollingQuery::parse(&q.to_query()), Ok(q));
        assert_eq!(RollingQuery::parse("epochs=1").unwrap().first_epoch, 0);
        for bad in ["", "first_epoch=2", "epochs=2&epochs=3", "epochs=x", "epochs=2&format=tar", "epochs=1&zip=1"] {
            assert!(matches!(RollingQuery::parse(bad), Err(ApiError::BadRequest(_))), "{bad}");
        }
    }

    #[test]
    fn queries() {
        let q = BatchQuery::parse("batch_size=32&seed=7&shuffle=none&drop_last=true&format=tar").unwrap();
        assert_eq!(
            q.plan,
            PlanOptions { batch_size: 32, seed: 7, shuffle: Shuffle::None, drop_last: true, block_bytes: 0 }
        );
        assert_eq!(q.format, BatchFormat::Tar);
        assert_eq!(BatchQuery::parse(&q.to_query()), Ok(q));
        assert_eq!(BatchQuery::parse(""), Ok(BatchQuery::default()));
        assert_eq!(BatchQuery::parse("format=tfrecord%2Eidx").unwrap().format, BatchFormat::TfrecordIdx);
        for bad in [
            "batch_size=0",
            "batch_size=-1",
            "seed=x",
            "shuffle=local",
            "format=zip",
            "x=1",
            "seed=1&seed=2",
            "drop_last=maybe",
            "seed",
            "block_bytes=4Q",
            "block_bytes=-1",
            "block_bytes",
            "block_bytes=1&block_bytes=2",
        ] {
            assert!(matches!(BatchQuery::parse(bad), Err(ApiError::BadRequest(_))), "{bad}");
        }
    }

    #[test]
    fn block_bytes_queries() {
        let q = BatchQuery::parse("shuffle=blocks&block_bytes=4G&batch_size=64").unwrap();
        assert_eq!((q.plan.shuffle, q.plan.block_bytes, q.plan.batch_size), (Shuffle::Blocks, 4 << 30, 64));
        assert_eq!(
            q.to_query(),
            "batch_size=64&seed=0&shuffle=blocks&drop_last=false&block_bytes=4294967296&format=tfrecord"
        );
        assert_eq!(BatchQuery::parse(&q.to_query()), Ok(q));
        assert_eq!(BatchQuery::parse("block_bytes=512M").unwrap().plan.block_bytes, 512 << 20);
        assert_eq!(BatchQuery::parse("block_bytes=1048577").unwrap().plan.block_bytes, 1_048_577);
        // Not given and 0 are one: the server's default. The string is what it was before the key.
        assert_eq!(BatchQuery::parse("block_bytes=0"), Ok(BatchQuery::default()));
        let blocks = BatchQuery::parse("shuffle=blocks").unwrap();
        assert_eq!(blocks.plan.block_bytes, 0);
        assert_eq!(blocks.to_query(), "batch_size=256&seed=0&shuffle=blocks&drop_last=false&format=tfrecord");
        assert_eq!(
            BatchQuery::default().to_query(),
            "batch_size=256&seed=0&shuffle=global&drop_last=false&format=tfrecord"
        );
        let err = BatchQuery::parse("block_bytes=4Q").unwrap_err().to_string();
        assert_eq!(
            err,
            "block_bytes must be a size such as 4G or 512M: \"4Q\" has an unknown size suffix (use K, M, G or T)"
        );
        let rolling = RollingQuery::parse("shuffle=blocks&block_bytes=2G&epochs=3").unwrap();
        assert_eq!(rolling.plan.block_bytes, 2 << 30);
        assert_eq!(RollingQuery::parse(&rolling.to_query()), Ok(rolling));
        let mut q = BatchQuery::default();
        assert_eq!(q.set("block_bytes", Some("1G")), Ok(true), "the mount's -o block_bytes=1G");
        assert_eq!(q.plan.block_bytes, 1 << 30);
        assert!(QUERY_KEYS.contains("block_bytes"));
    }

    proptest! {
        #[test]
        fn plan_queries_round_trip(
            batch_size in 1u32..=crate::plan::MAX_BATCH_SIZE,
            seed: u64,
            shuffle in prop_oneof![Just(Shuffle::Global), Just(Shuffle::None), Just(Shuffle::Blocks)],
            drop_last: bool,
            block_bytes in prop_oneof![Just(0u64), any::<u64>()],
        ) {
            let plan = PlanOptions { batch_size, seed, shuffle, drop_last, block_bytes };
            let q = BatchQuery { plan, format: BatchFormat::Tar };
            prop_assert_eq!(BatchQuery::parse(&q.to_query()), Ok(q));
            prop_assert_eq!(q.to_query().contains("block_bytes"), block_bytes != 0);
        }
    }

    /// The one set of spellings and errors, for queries and mount options alike.
    #[test]
    fn plan_options_parse_one_way() {
        let set = |key: &str, value: Option<&str>| {
            let mut q = BatchQuery::default();
            q.set(key, value).map(|known| (known, q))
        };
        for (value, want) in [(None, true), (Some("true"), true), (Some("1"), true), (Some("yes"), true)] {
            assert_eq!(set("drop_last", value).unwrap().1.plan.drop_last, want, "{value:?}");
        }
        for value in ["false", "0", "no"] {
            assert!(!set("drop_last", Some(value)).unwrap().1.plan.drop_last, "{value}");
        }
        assert!(BatchQuery::parse("drop_last").unwrap().plan.drop_last, "a bare key in a query too");
        let err = |key, value: &str| set(key, Some(value)).unwrap_err().to_string();
        // Overflow is out of range like any other size, never clamped.
        assert_eq!(
            err("batch_size", "4294967296"),
            format!("batch_size must be between 1 and {}, got 4294967296", crate::plan::MAX_BATCH_SIZE)
        );
        assert_eq!(
            err("batch_size", "0"),
            format!("batch_size must be between 1 and {}, got 0", crate::plan::MAX_BATCH_SIZE)
        );
        assert_eq!(
            err("batch_size", "99999999999999999999"),
            format!("batch_size must be between 1 and {}, got 99999999999999999999", crate::plan::MAX_BATCH_SIZE)
        );
        assert_eq!(
            err("seed", "99999999999999999999"),
            format!("seed is too large: at most {}, got 99999999999999999999", u64::MAX)
        );
        assert_eq!(err("seed", "x"), "seed must be a non-negative integer, got \"x\"");
        assert_eq!(set("seed", None).unwrap_err().to_string(), "seed needs a value (seed=...)");
        let (known, q) = set("cache", Some("1G")).unwrap();
        assert!(!known && q == BatchQuery::default(), "other keys are left to the caller");
        let (_, q) = set("batch_size", Some("64")).unwrap();
        assert_eq!(q.plan.batch_size, 64);
    }

    #[test]
    fn ranges() {
        use RangeRequest::*;
        assert_eq!(parse_range(None, 10), Full);
        assert_eq!(parse_range(Some("bytes=0-3"), 10), Partial { start: 0, end: 4 });
        assert_eq!(parse_range(Some("bytes=5-"), 10), Partial { start: 5, end: 10 });
        assert_eq!(parse_range(Some("bytes=-3"), 10), Partial { start: 7, end: 10 });
        assert_eq!(parse_range(Some("bytes=-30"), 10), Partial { start: 0, end: 10 });
        assert_eq!(parse_range(Some("bytes=8-100"), 10), Partial { start: 8, end: 10 });
        assert_eq!(parse_range(Some("bytes=10-"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=-0"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=0-1,4-5"), 10), Full);
        assert_eq!(parse_range(Some("items=0-1"), 10), Full);
        assert_eq!(parse_range(Some("bytes=5-2"), 10), Full);
        // Past what a u64 holds: still a range (they were ignored, a 200), to the end or past it.
        assert_eq!(parse_range(Some("bytes=0-99999999999999999999999"), 10), Partial { start: 0, end: 10 });
        assert_eq!(parse_range(Some("bytes=99999999999999999999999-"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=99999999999999999999999-99999999999999999999999"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=-99999999999999999999"), 10), Partial { start: 0, end: 10 });
        // Digits only: a sign is no number (`bytes=+1-+2` was a 206).
        for h in ["bytes=+1-+2", "bytes=+1-", "bytes=-+3", "bytes=1-+2", "bytes=0x1-2"] {
            assert_eq!(parse_range(Some(h), 10), Full, "{h}");
        }
    }

    /// `str::parse` takes a leading `+`: `/epochs/+1` was served as epoch 1, `batch_size=+4` as 4.
    #[test]
    fn numbers_are_digits_only() {
        for path in ["/v1/datasets/d/epochs/+1", "/v1/datasets/d/epochs/0/batches/+2", "/v1/datasets/d/epochs/-0"] {
            assert!(matches!(Route::parse(path), Err(ApiError::BadRequest(_))), "{path}");
        }
        assert_eq!(Route::parse("/v1/datasets/d/epochs/01"), Ok(Route::Manifest { name: "d".into(), epoch: 1 }));
        assert!(BatchQuery::parse("batch_size=%2B4").is_err());
        assert!(FilesQuery::parse("cursor=%2B4").is_err());
        assert!(matches!(number("n", "99999999999999999999"), Err(ApiError::BadRequest(m)) if m.contains("too large")));
    }

    /// `u8::from_str_radix` takes a sign: `%+5` decoded as byte 5.
    #[test]
    fn percent_escapes_are_two_hex_digits() {
        assert_eq!(percent_decode("a%2Fb%2f").as_deref(), Some("a/b/"));
        for s in ["%+5", "%-5", "% 5", "%5", "%g0", "a%+5b"] {
            assert_eq!(percent_decode(s), None, "{s}");
        }
        assert!(Route::parse("/v1/datasets/d/files/a%+5b").is_err());
    }

    #[test]
    fn paths_roundtrip() {
        let p = file_path("set one", "cls a/x#1.jpg");
        assert_eq!(Route::parse(&p), Ok(Route::File { name: "set one".into(), path: "cls a/x#1.jpg".into() }));
        assert_eq!(Route::parse(&batch_path("d/x", 2, 9)), Ok(Route::Batch { name: "d/x".into(), epoch: 2, batch: 9 }));
    }

    proptest! {
        #[test]
        fn range_is_within_body(h in "bytes=[0-9]{0,4}-[0-9]{0,4}", len in 0u64..5000) {
            if let RangeRequest::Partial { start, end } = parse_range(Some(&h), len) {
                prop_assert!(start < end && end <= len);
            }
        }

        #[test]
        fn parsers_never_panic(s in "\\PC{0,60}") {
            let _ = Route::parse(&s);
            let _ = BatchQuery::parse(&s);
            let _ = RollingQuery::parse(&s);
            let _ = parse_range(Some(&s), 100);
        }
    }
}
