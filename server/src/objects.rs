//! Datasets in object stores: `s3://BUCKET/PREFIX` (AWS S3 and S3-compatible stores such as SeaweedFS,
//! Ceph RGW or MinIO), through Apache `object_store`.
//!
//! The rooms, each a file of `objects/`:
//! - `store.rs`: the URL, the client built from the settings (the standard AWS environment:
//!   `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT_URL`,
//!   `AWS_ALLOW_HTTP`, web identity, container and instance credentials; then the dataset's `[dataset.s3]`
//!   table, whose keys are `object_store`'s), the listing and what its errors mean;
//! - `context.rs`: what a server's object datasets share ([`ObjectContext`]): the runtime their requests
//!   run on, the GETs in flight per bucket, the block cache and the disk tier;
//! - `indexing.rs`: reading each object once to index it, and `etag.rs`: what its ETag says of the bytes
//!   read (a copy corrupted on the way never indexed);
//! - `units.rs`: the checkable units of an object, chunks that end at one, and coalescing;
//! - `fetch.rs`: ranged GETs, checked, retried, through the block cache (`cache.rs`) or the tier;
//! - `tier.rs`, `stage.rs` and `maps.rs`: the disk tier, copying whole objects into it in plan order,
//!   and keeping its copies open between reads (mapped, or opened for direct reads), as local shards are.
//!
//! **Indexing** lists the prefix (names, sizes, ETags, last-modified: the index records them, and a
//! listing that differs rebuilds it), then reads each object once: one larger than `object_part` by
//! ranged GETs of that size, several at once, into a copy on local disk that the format's indexer reads
//! like a local shard (an LMDB environment is opened by LMDB itself, so it must be a file): the copy is
//! kept in the disk tier where there is one, else removed once indexed. Smaller objects (a file tree's)
//! are read many at once, in memory, and kept in the tier too. A copy is checked against the object's
//! ETag (`etag.rs`: a multipart upload's too), or read again until two reads agree where the ETag cannot
//! tell. The index is kept in `index_dir` and, with `index_in_bucket`, beside the
//! data as `PREFIX/.batchfs-index`.
//!
//! **Held in memory.** Whole objects within the server's `resident` budget are read once at start (from
//! the tier where it has them) and served from memory like mapped shards (`storage.rs`).
//!
//! **Serving** the others reads from the disk tier what it holds (`tier.rs`), and the rest by ranged
//! GETs, each carrying `If-Match` with the indexed ETag. What is fetched is always whole *units* the
//! index can check (`units.rs`): a sample's part, a TFRecord part's whole frame, or (for the ranges of
//! `raw/` and whatever lies outside the parts) the [`CHUNK_BYTES`](batchfs::index::CHUNK_BYTES) chunks of
//! the object. Units of one object that lie within `object_gap` bytes of each other are read by one GET
//! (LMDBIO's coalescing), and every unit is checked before anything is sent or kept, so a byte the store
//! (or the network) gets wrong is refetched, never served. Checked units are kept in the block cache of
//! `object_cache` bytes; a unit being fetched is waited for rather than fetched twice. Meanwhile, with a
//! tier, whole objects are copied into it in the order the epoch's plan first needs them (`stage.rs`).
//!
//! **Faults.** `object_store` retries throttling (`503 SlowDown`), `5xx`, resets and timeouts with
//! backoff, and a GET that still fails is made again while `object_retry_for` lasts; a unit that still
//! fails its check after [`FETCH_ATTEMPTS`] reads is an error. An object whose ETag is no longer the
//! indexed one (`412`, a different ETag or size, or gone) is *changed*: its shard is refused from then on
//! (see `storage.rs`), and a restart re-indexes it.

mod cache;
mod context;
mod etag;
mod fetch;
mod indexing;
mod making;
mod maps;
pub mod recheck;
mod stage;
mod store;
pub mod tier;
pub mod units;

pub use context::ObjectContext;
pub use fetch::ReadError;
pub use store::Bucket;
pub use units::{coalesce, take_of, units_of, Read, Unit};

use crate::config::ServerLimits;
use batchfs::index::{Index, ShardInfo};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::Semaphore;

pub use crate::policy::is_object_url;

/// An error of the store's on one line: its words, which may carry the store's XML answer over several
/// lines, joined (each cause once, on one line, as the server's errors are).
fn one_line(e: &object_store::Error) -> String {
    e.to_string().split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Why an object dataset cannot be opened: each says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("{url}: expected s3://BUCKET or s3://BUCKET/PREFIX")]
    BadUrl { url: String },
    #[error("{url}: {bucket:?} is no bucket name (letters, digits, '.', '-' and '_')")]
    BadBucket { url: String, bucket: String },
    #[error(
        "{url}: the endpoint {endpoint:?} is no URL of the form http(s)://HOST[:PORT] (AWS_ENDPOINT_URL, or the \
         dataset's endpoint setting)"
    )]
    BadEndpoint { url: String, endpoint: String },
    #[error(
        "{url}: the endpoint {endpoint} is plain HTTP, which the S3 client refuses unless told: set \
         AWS_ALLOW_HTTP=true (or allow_http = \"true\" in [dataset.s3])"
    )]
    HttpNotAllowed { url: String, endpoint: String },
    #[error("{url}: unknown setting {key:?} in [dataset.s3] (object_store's S3 keys: endpoint, region, ...)")]
    BadSetting { url: String, key: String },
    #[error(
        "{url}: {key} = {value:?} ({whence}) is no switch: give true or false (also taken, in any case: 1 or 0, \
         yes or no, y or n, on or off)"
    )]
    BadSwitch { url: String, key: String, value: String, whence: &'static str },
    #[error("{url}: {key} = {value:?} in [dataset.s3] is refused by the S3 client: {}", one_line(.source))]
    BadValue { url: String, key: String, value: String, source: Box<object_store::Error> },
    #[error("{url}: {}", one_line(.source))]
    Config { url: String, source: Box<object_store::Error> },
    #[error("{url}: bucket {bucket:?} does not exist at {endpoint} ({})", one_line(.source))]
    NoBucket { url: String, bucket: String, endpoint: String, source: Box<object_store::Error> },
    #[error(
        "{url}: access denied at {endpoint}: check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, \
         AWS_SESSION_TOKEN) and that they may list and read the bucket ({})",
        one_line(.source)
    )]
    Denied { url: String, endpoint: String, source: Box<object_store::Error> },
    #[error(
        "{url}: cannot reach the object store at {endpoint}: check the endpoint (AWS_ENDPOINT_URL, or the \
         dataset's endpoint setting), the network and object_timeout ({})",
        one_line(.source)
    )]
    Unreachable { url: String, endpoint: String, source: Box<object_store::Error> },
    #[error(
        "{url}: no credentials: none in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or the \
         dataset's settings, and the instance metadata service (169.254.169.254) gave none ({})",
        one_line(.source)
    )]
    NoCredentials { url: String, source: Box<object_store::Error> },
    #[error(
        "{url}: no credentials: none in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or the \
         dataset's settings, and AWS_EC2_METADATA_DISABLED says not to ask the instance metadata service (for a \
         public bucket, skip_signature = true)"
    )]
    MetadataOff { url: String },
    #[error("{url}: cannot list the objects ({})", one_line(.source))]
    List { url: String, source: Box<object_store::Error> },
    #[error("{url}: no objects under this prefix")]
    Empty { url: String },
    #[error("{url}: an object, not a prefix: a dataset is the objects under a prefix (s3://{bucket}/{folder})")]
    AnObject { url: String, bucket: String, folder: String },
}

/// Where an object dataset is and how to read it.
pub struct ObjectsAt<'a> {
    /// `s3://BUCKET/PREFIX`.
    pub url: &'a str,
    /// The `[dataset.s3]` settings, over the `AWS_*` environment.
    pub settings: &'a BTreeMap<String, String>,
    /// Keep the index beside the data too, as `PREFIX/.batchfs-index` in the bucket, and reuse it from
    /// there (a new replica then reads no sample to start).
    pub index_in_bucket: bool,
    /// What the server's object datasets share.
    pub context: Arc<ObjectContext>,
}

/// How object datasets are read: the server's `object_*` limits.
#[derive(Debug, Clone)]
pub struct ObjectLimits {
    pub requests: usize,
    pub cache: u64,
    pub gap: u64,
    pub part: u64,
    pub timeout: Duration,
    pub retry_for: Duration,
    /// Whole objects copied into the tier at once, and GETs in flight for them (`stage_objects`).
    pub stage_objects: usize,
    /// Room for the parts being copied into the tier at once, server-wide, a MiB each (what a part holds
    /// while its body is written as it arrives: its aligned buffer, or its pages before their writeback
    /// starts): an eighth of the memory the server may use, within 2 parts and 512 MiB.
    pub staging_bytes: u64,
    /// Bytes of GETs in flight, server-wide (their bodies are held whole until they are checked; a
    /// copy's, written as it arrives, counts a MiB): an eighth of the memory the server may use, within 2
    /// parts and 512 MiB.
    pub get_bytes: u64,
    /// Rechecks of the tier's copies running at once (`recheck_concurrency`).
    pub rechecks: usize,
}

impl ObjectLimits {
    /// The limits of a server with `limits`, which may use `memory` bytes (the machine's, or its memory
    /// cgroup's limit): the block cache takes at most an eighth of it.
    pub fn of(limits: &ServerLimits, memory: u64) -> Self {
        let part = limits.object_part.max(64 << 10);
        ObjectLimits {
            requests: limits.object_requests.max(1),
            cache: limits.object_cache.min(memory / 8),
            gap: limits.object_gap,
            part,
            timeout: limits.object_timeout,
            retry_for: limits.object_retry_for,
            stage_objects: limits.stage_objects.max(1),
            staging_bytes: (memory / 8).clamp(2 * part, (512 << 20).max(2 * part)),
            get_bytes: (memory / 8).clamp(2 * part, (512 << 20).max(2 * part)),
            rechecks: limits.recheck_concurrency.max(1),
        }
    }
}

/// Reads of one object dataset, counted (exported per dataset at `/metrics`).
#[derive(Debug, Default)]
pub struct ObjectCounters {
    /// GET requests sent (ranged reads, indexing's and staging's among them; retries inside
    /// `object_store` not).
    pub gets: AtomicU64,
    /// Bytes read from the bucket.
    pub bytes: AtomicU64,
    /// Bytes served from the block cache (or from a fetch another body was already waiting on).
    pub cache_hit_bytes: AtomicU64,
    /// Units refetched because they failed their checksum.
    pub bad_checksums: AtomicU64,
    /// Bytes served from copies in the disk tier.
    pub tier_hit_bytes: AtomicU64,
    /// Of those, bytes read by the direct path of local shards (copies read with `O_DIRECT`).
    pub tier_direct_bytes: AtomicU64,
    /// GETs that failed on the way (`object_store`'s own retries spent, or a body cut short) and were made
    /// again.
    pub retried_gets: AtomicU64,
    /// One warning of retried GETs per [`RETRY_LOG_EVERY`].
    retries_logged: Throttled,
    /// Reads of the store given up after `object_retry_for` (their bodies cut: the clients retry).
    pub failed_reads: AtomicU64,
    /// One warning of reads given up per [`RETRY_LOG_EVERY`].
    failures_logged: Throttled,
}

/// A warning said at most once per [`RETRY_LOG_EVERY`], with how many of its kind were held back since: a
/// failure repeated by every GET or copy (a store down, a full disk) is seen, and does not flood the log.
#[derive(Debug, Default)]
pub struct Throttled(std::sync::Mutex<(Option<std::time::Instant>, u64)>);

impl Throttled {
    /// Whether to say this one now, and if so how many were held back before it.
    pub fn pass(&self) -> Option<u64> {
        let mut last = self.0.lock().expect("throttled");
        if last.0.is_some_and(|at| at.elapsed() < RETRY_LOG_EVERY) {
            last.1 += 1;
            return None;
        }
        let held = std::mem::take(&mut last.1);
        last.0 = Some(std::time::Instant::now());
        Some(held)
    }
}

/// A store failing GETs is logged at most this often (with how many failed since), not once per GET.
pub const RETRY_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

impl ObjectCounters {
    /// Counts a GET made again after `error`, and says so at most once per [`RETRY_LOG_EVERY`]: a store
    /// that stalls or resets is seen at the default level, and a long outage does not flood the log.
    /// Returns whether this one was logged.
    pub fn retried(&self, dataset: &str, error: &dyn std::fmt::Display) -> bool {
        self.retried_gets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some(held) = self.retries_logged.pass() else { return false };
        tracing::warn!(%dataset, %error, failed = held + 1, "GETs of the store failed: asking again");
        true
    }

    /// Counts a read of the store given up after `object_retry_for` with `error`, and says so at most once
    /// per [`RETRY_LOG_EVERY`]: a store that stops answering (frozen, a partition) failed its first GET
    /// past the whole of `object_retry_for`, which was never counted or logged, and the body it cut looked
    /// to the server's log like any other. Returns whether this one was logged.
    pub fn gave_up(&self, dataset: &str, error: &dyn std::fmt::Display) -> bool {
        self.failed_reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some(held) = self.failures_logged.pass() else { return false };
        tracing::warn!(
            %dataset,
            %error,
            failed = held + 1,
            "reads of the store failed for object_retry_for: a body that needed them is cut (its client retries), a \
             copy into the disk tier is dropped"
        );
        true
    }
}

/// How many times a unit is read before its failing checksum is an error.
pub const FETCH_ATTEMPTS: u32 = 8;

/// An object dataset: its bucket, its index (once attached) and the units the index can check.
pub struct ObjectSource {
    bucket: Bucket,
    shown: PathBuf,
    requests: Arc<Semaphore>,
    context: Arc<ObjectContext>,
    /// Where indexing stages each object when there is no tier.
    stage_dir: PathBuf,
    /// The index is kept in the bucket too ([`ObjectsAt::index_in_bucket`]).
    index_in_bucket: bool,
    /// The index, once [`ObjectSource::attach`]ed: its files by storage number (shards, then side files).
    index: OnceLock<Arc<Index>>,
    /// The parts of the shards as units (TFRecord shards': their frames), sorted by object and offset;
    /// a part that is its whole shard is left out, as [`units_of`] reads it as the shard's chunk.
    parts: OnceLock<Vec<Unit>>,
    /// Distinguishes this dataset's units in the shared block cache.
    id: u64,
    pub counters: ObjectCounters,
    /// Copies whole objects into the tier in plan order (with a tier).
    stager: stage::Stager,
    /// The copies in the tier, mapped.
    maps: Arc<maps::Kept<Arc<batchfs::mmap::MappedFile>>>,
    /// Copies not mapped are read with `O_DIRECT` (a dataset larger than half the server's memory).
    direct_copies: std::sync::atomic::AtomicBool,
    /// The copies opened with `O_DIRECT`, kept open for the next reads of their objects.
    open_copies: Arc<maps::Kept<Arc<std::fs::File>>>,
    /// Indexing said that an object's ETag could not vouch for its bytes (it is said once a dataset).
    unvouched_noted: std::sync::atomic::AtomicBool,
}

impl ObjectSource {
    /// Connects to the bucket of `at.url` and lists it, so that a wrong bucket, endpoint or credential is
    /// reported now, before anything is served. Returns the source and its objects (relative paths,
    /// sorted; hidden names left out), as [`ShardInfo`]s.
    pub fn open(at: ObjectsAt, stage_dir: PathBuf) -> Result<(ObjectSource, Vec<ShardInfo>), ObjectError> {
        let bucket = Bucket::connect(at.url, at.settings, &at.context.limits)?;
        Self::of_bucket(bucket, at.context, stage_dir, at.index_in_bucket)
    }

    /// [`ObjectSource::open`] of a bucket reached already (an in-memory store, in tests).
    pub fn of_bucket(
        bucket: Bucket,
        context: Arc<ObjectContext>,
        stage_dir: PathBuf,
        index_in_bucket: bool,
    ) -> Result<(ObjectSource, Vec<ShardInfo>), ObjectError> {
        let source = ObjectSource {
            shown: PathBuf::from(&bucket.url),
            requests: context.bucket_requests(&format!("{} {}", bucket.endpoint, bucket.bucket)),
            id: context.next_id(),
            bucket,
            context,
            stage_dir,
            index_in_bucket,
            index: OnceLock::new(),
            parts: OnceLock::new(),
            counters: ObjectCounters::default(),
            stager: stage::Stager::default(),
            maps: Arc::default(),
            direct_copies: std::sync::atomic::AtomicBool::new(false),
            open_copies: Arc::default(),
            unvouched_noted: std::sync::atomic::AtomicBool::new(false),
        };
        if let Some(tier) = source.tier() {
            // Told of each copy the tier lets go, so that none is kept open past its last body's read.
            tier.keep_with(Arc::downgrade(&source.maps) as std::sync::Weak<dyn tier::Keeper>);
            tier.keep_with(Arc::downgrade(&source.open_copies) as std::sync::Weak<dyn tier::Keeper>);
        }
        indexing::remove_dead_stages(&source.stage_dir);
        let listed = source.context.block_here(source.bucket.list_within(source.limits().retry_for))?;
        Ok((source, listed))
    }

    /// Where the index is kept in the bucket (`PREFIX/.batchfs-index`), where it is kept there.
    pub fn index_in_bucket_at(&self) -> Option<String> {
        self.index_in_bucket.then(|| format!("{}/{}", self.bucket.url, batchfs::source::INDEX_FILE_NAME))
    }

    /// The dataset's URL, for messages.
    pub fn url(&self) -> &str {
        &self.bucket.url
    }

    fn limits(&self) -> &ObjectLimits {
        &self.context.limits
    }

    /// The disk tier, if the server has one.
    pub fn tier(&self) -> Option<&Arc<tier::Tier>> {
        self.context.tier.as_ref()
    }

    /// Whether the disk tier holds a copy of every shard of the attached index now (none without a tier
    /// or an index): such a dataset reads nothing from the store while the copies stay.
    pub fn tier_holds_every_shard(&self) -> bool {
        let (Some(tier), Some(index)) = (self.tier(), self.index.get()) else { return false };
        index.shards.iter().all(|file| tier.contains(&self.tier_name(file)))
    }

    /// Takes the index (its files: shards, then side files, the storage numbering) and the checksums
    /// of their units, for serving.
    pub fn attach(&self, index: Arc<Index>) {
        let frames = index.format() == batchfs::index::SourceFormat::Tfrecord;
        let mut parts: Vec<Unit> = Vec::new();
        for part in index.samples.iter().flat_map(|s| &s.parts) {
            let shard = &index.shards[part.shard as usize];
            if !frames && part.offset == 0 && part.len == shard.size {
                continue;
            }
            let (offset, len) = match frames {
                true => (part.offset - batchfs::tfrecord::HEADER_LEN, batchfs::tfrecord::frame_len(part.len)),
                false => (part.offset, part.len),
            };
            parts.push(Unit { object: part.shard, offset, len, crc32c: part.crc32c, frame: frames });
        }
        parts.sort_unstable();
        parts.dedup();
        parts.shrink_to_fit();
        let _ = self.parts.set(parts);
        let _ = self.index.set(index);
    }

    /// Object `n` (storage number), as indexed.
    fn file(&self, n: u32) -> Option<&ShardInfo> {
        let index = self.index.get()?;
        let n = n as usize;
        index.shards.get(n).or_else(|| index.side.get(n.checked_sub(index.shards.len())?))
    }

    /// How many objects the dataset has (shards and side files).
    fn objects(&self) -> usize {
        self.index.get().map_or(0, |i| i.shards.len() + i.side.len())
    }

    /// Object `n`'s path shown in messages.
    pub fn path_of(&self, n: u32) -> PathBuf {
        match self.file(n) {
            Some(f) => PathBuf::from(format!("s3://{}/{}", self.bucket.bucket, self.bucket.location(&f.path))),
            None => self.shown.clone(),
        }
    }

    /// The name of object `file`'s copy in the disk tier (its endpoint, bucket, key and ETag).
    fn tier_name(&self, file: &ShardInfo) -> String {
        let key = format!("{} {}/{}", self.bucket.endpoint, self.bucket.bucket, self.bucket.location(&file.path));
        tier::Tier::name(&key, &file.etag.to_string())
    }

    /// The units whose bytes hold `len` bytes at `offset` of object `n` ([`units_of`]).
    pub fn units(&self, n: u32, offset: u64, len: u64) -> Vec<Unit> {
        let all = self.parts.get().map_or(&[][..], Vec::as_slice);
        let (from, to) = (all.partition_point(|u| u.object < n), all.partition_point(|u| u.object <= n));
        match self.file(n) {
            Some(file) => units_of(&all[from..to], file, n, offset, len),
            None => Vec::new(),
        }
    }

    /// Whether reading `bytes` ahead of the bodies that want them into the block cache is worth it: only
    /// while the cache can hold them several times over (8), or they would be evicted by the bodies' own
    /// traffic before they are wanted, and read twice.
    pub fn worth_reading_ahead(&self, bytes: u64) -> bool {
        self.context.cache.worth_reading_ahead(bytes)
    }

    /// How many of the `len` bytes at `offset` of object `n` a body chunk with `room` bytes left takes:
    /// up to the last unit end that fits, so that a unit is never split between two chunks (each would
    /// fetch it whole); where none fits, nothing, or, in a chunk still `empty`, the first unit whole
    /// (a sample larger than `chunk_size` is one chunk).
    pub fn take(&self, n: u32, offset: u64, len: u64, room: u64, empty: bool) -> u64 {
        take_of(&self.units(n, offset, len), offset, len, room, empty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Dataset;
    use crate::policy::{AutoSize, IoMode, IoPolicy};
    use batchfs::source::{IndexOptions, NoProgress};
    use object_store::memory::InMemory;
    use object_store::throttle::{ThrottleConfig, ThrottledStore};
    use object_store::ObjectStore;
    use object_store::ObjectStoreExt;
    use std::path::Path;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    /// The store's XML answer over several lines is said on the error's one line (it came on a second).
    #[test]
    fn a_store_error_over_several_lines_is_said_on_one() {
        let source = Box::new(object_store::Error::Generic {
            store: "S3",
            source: "404 Not Found: <?xml version=\"1.0\"?>\n<Error><Code>NoSuchBucket</Code>\n</Error>".into(),
        });
        let e = ObjectError::NoBucket { url: "s3://b/p".into(), bucket: "b".into(), endpoint: "e".into(), source };
        let said = e.to_string();
        assert!(!said.contains('\n') && said.contains("<Error><Code>NoSuchBucket</Code> </Error>"), "{said}");
    }

    /// Every file of `dir` put into `store` under `prefix/`.
    pub(super) fn upload(store: &InMemory, dir: &Path, prefix: &str) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let bytes = std::fs::read(&path).unwrap();
            runtime.block_on(store.put(&format!("{prefix}/{name}").into(), bytes.into())).unwrap();
        }
    }

    /// A context with a tier of `tier` bytes in `dir` (none where `dir` is `None`).
    pub(super) fn context(dir: Option<&Path>, tier: u64) -> Arc<ObjectContext> {
        let limits = ServerLimits {
            disk_cache: crate::policy::TierDir(dir.map(Path::to_owned)),
            disk_cache_size: AutoSize::Bytes(tier),
            ..Default::default()
        };
        ObjectContext::new(&limits).unwrap()
    }

    /// The dataset `s3://b/ds` of `store`, read by GETs (nothing held in memory), its index in `index_dir`.
    pub(super) fn open<S: ObjectStore>(store: &Arc<S>, context: &Arc<ObjectContext>, index_dir: &Path) -> Dataset {
        open_holding(store, context, index_dir, 0)
    }

    /// [`open`], with `resident` bytes of whole objects held in the server's memory.
    fn open_holding<S: ObjectStore>(
        store: &Arc<S>,
        context: &Arc<ObjectContext>,
        index_dir: &Path,
        resident: u64,
    ) -> Dataset {
        let io = IoPolicy {
            mode: IoMode::Auto,
            max_mapped_shards: 4096,
            memory: u64::MAX,
            resident,
            resident_auto: false,
            sendfile: false,
        };
        open_with(store, context, index_dir, io)
    }

    /// [`open`], read as `io` says.
    fn open_with<S: ObjectStore>(
        store: &Arc<S>,
        context: &Arc<ObjectContext>,
        index_dir: &Path,
        io: IoPolicy,
    ) -> Dataset {
        let bucket = Bucket::of_store("s3://b/ds", store.clone() as Arc<dyn ObjectStore>, "memory").unwrap();
        let opened = ObjectSource::of_bucket(bucket, context.clone(), index_dir.to_owned(), false).unwrap();
        Dataset::of_objects("ds", opened, Some(index_dir), &IndexOptions::default(), &NoProgress, io).unwrap()
    }

    /// The files of `dir` in an in-memory bucket, opened with no tier (every read a GET through the block
    /// cache); the index's directory lives as long as the dataset is used.
    fn opened_by_gets(dir: &Path) -> (Dataset, tempfile::TempDir) {
        let store = Arc::new(InMemory::new());
        upload(&store, dir, "ds");
        let index_dir = tempfile::tempdir().unwrap();
        (open(&store, &context(None, 0), index_dir.path()), index_dir)
    }

    /// Three objects copied into a tier, then opened by a server of 64 KiB: the dataset does not fit in
    /// half its memory, so the copies are read with O_DIRECT, not mapped. The local copy, the tier's and
    /// the index's directories (to outlive the dataset), and the dataset.
    fn opened_with_direct_copies() -> (tempfile::TempDir, [tempfile::TempDir; 2], Dataset) {
        let (local, _) = crate::storage::fixtures::dataset(150, 30_001, 3);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let ctx = context(Some(tier_dir.path()), 1 << 30);
        drop(open(&store, &ctx, index_dir.path()));
        let ds = open_with(&store, &ctx, index_dir.path(), direct_policy(0));
        (local, [tier_dir, index_dir], ds)
    }

    /// How a server of 64 KiB with `resident=auto` (here `resident` bytes) reads: datasets not mapped.
    fn direct_policy(resident: u64) -> IoPolicy {
        IoPolicy {
            mode: IoMode::Auto,
            max_mapped_shards: 4096,
            memory: 64 << 10,
            resident,
            resident_auto: true,
            sendfile: false,
        }
    }

    /// Every shard of `ds` read whole through its storage, against the local copy in `dir`.
    pub(super) fn read_all_and_compare(ds: &Dataset, dir: &Path) {
        for (n, shard) in ds.index.shards.iter().enumerate() {
            // In three pieces, the last one past a chunk boundary where the shard has one.
            let cuts = [0, shard.size / 3, shard.size / 2, shard.size];
            let wanted: Vec<(u32, u64, u64)> = cuts.windows(2).map(|w| (n as u32, w[0], w[1] - w[0])).collect();
            let got = ds.storage.read_objects(&wanted).unwrap().concat();
            assert_eq!(got, std::fs::read(dir.join(&shard.path)).unwrap(), "shard {}", shard.path);
        }
    }

    pub(super) fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_dataset_that_fits_is_copied_into_the_tier_read_from_it_and_found_again_after_a_restart() {
        let (local, _) = crate::storage::fixtures::dataset(300, 40_000, 5);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let ctx = context(Some(tier_dir.path()), 1 << 30);
        let ds = open(&store, &ctx, index_dir.path());
        let source = ds.storage.objects().unwrap().clone();
        let tier = ctx.tier.clone().unwrap();
        // Indexing copied every object into the tier already (whole, checked against the ETag where it
        // is an MD5); the reads come from there.
        assert_eq!(tier.copies(), ds.index.shards.len());
        let gets = source.counters.gets.load(Ordering::Relaxed);
        read_all_and_compare(&ds, local.path());
        assert_eq!(source.counters.gets.load(Ordering::Relaxed), gets, "no GET for what the tier holds");
        assert!(source.counters.tier_hit_bytes.load(Ordering::Relaxed) > 0);
        drop((ds, source, ctx));

        // Restarted, the index kept: no object is read from the store, and every copy is checked again
        // before it is first served. One copy changed on the disk meanwhile: it is removed and read by GETs.
        let copies: Vec<PathBuf> =
            std::fs::read_dir(tier_dir.path().join("objects")).unwrap().map(|e| e.unwrap().path()).collect();
        let mut bad = std::fs::read(&copies[0]).unwrap();
        bad[7] ^= 1;
        std::fs::write(&copies[0], bad).unwrap();
        let ctx = context(Some(tier_dir.path()), 1 << 30);
        let ds = open(&store, &ctx, index_dir.path());
        let source = ds.storage.objects().unwrap().clone();
        read_all_and_compare(&ds, local.path());
        let tier = ctx.tier.clone().unwrap();
        assert_eq!(tier.counters.failures.load(Ordering::Relaxed), 1);
        let reads_of_one = source.counters.gets.load(Ordering::Relaxed);
        assert!(reads_of_one > 0, "the changed copy is read from the store");
        // ... and copied in again, checked.
        wait_for("the copy made again", || tier.copies() == ds.index.shards.len());
        read_all_and_compare(&ds, local.path());
        assert_eq!(source.counters.gets.load(Ordering::Relaxed), reads_of_one);
    }

    /// A mapped copy truncated under the server (the tier's file cut by hand): the body that touches its
    /// end reads zeros (refused by the clients' checksums), and the next check before a body removes the
    /// copy, so what follows is read from the store. The copy was served on, zeros and all, unsaid.
    #[test]
    fn a_copy_truncated_under_the_server_is_removed_and_read_from_the_store() {
        batchfs::mmap::guard_truncation().unwrap();
        let (local, _) = crate::storage::fixtures::dataset(120, 40_000, 3);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let ctx = context(Some(tier_dir.path()), 1 << 30);
        let ds = open(&store, &ctx, index_dir.path());
        let (source, tier) = (ds.storage.objects().unwrap().clone(), ctx.tier.clone().unwrap());
        let map = ds.storage.mapping(0).expect("the copy mapped");
        let copy = tier.get(&source.tier_name(&ds.index.shards[0])).unwrap().0;
        let size = ds.index.shards[0].size;
        std::fs::OpenOptions::new().write(true).open(&copy).unwrap().set_len(size / 4).unwrap();
        let last = map.bytes()[size as usize - 1];
        assert!(map.was_cut() && last == 0, "a page past the new end reads zeros");
        let gets = source.counters.gets.load(Ordering::Relaxed);
        ds.storage.check(0).unwrap();
        assert_eq!(tier.counters.failures.load(Ordering::Relaxed), 1, "the copy removed");
        assert!(!copy.exists());
        assert!(ds.storage.mapping(0).is_none_or(|m| !m.was_cut()));
        read_all_and_compare(&ds, local.path());
        assert!(source.counters.gets.load(Ordering::Relaxed) > gets, "read from the store again");
        // ... and copied in again, before the tier's directory goes (the stager made it anew after).
        wait_for("the copy made again", || tier.copies() == ds.index.shards.len() && source.stager_idle());
    }

    #[test]
    fn objects_held_in_memory_are_read_from_their_copies_in_the_tier() {
        // Shards whose sizes are not whole pages: a copy is read into whole pages of memory.
        let (local, _) = crate::storage::fixtures::dataset(150, 30_001, 3);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let ctx = context(Some(tier_dir.path()), 1 << 30);
        let ds = open(&store, &ctx, index_dir.path());
        assert!(ds.index.shards.iter().any(|s| s.size % 4096 != 0));
        assert_eq!(ctx.tier.as_ref().unwrap().copies(), ds.index.shards.len());
        drop(ds);
        // Restarted with room to hold every shard: each is read from its copy, none from the store.
        let ds = open_holding(&store, &ctx, index_dir.path(), u64::MAX);
        let source = ds.storage.objects().unwrap().clone();
        assert_eq!(source.counters.gets.load(Ordering::Relaxed), 0, "a held object was read from the store");
        read_all_and_compare(&ds, local.path());
    }

    #[test]
    fn a_dataset_memory_holds_needs_no_tier_and_gets_no_note() {
        let (local, _) = crate::storage::fixtures::dataset(40, 30_000, 3);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let index_dir = tempfile::tempdir().unwrap();
        let ds = open_holding(&store, &context(None, 0), index_dir.path(), u64::MAX);
        assert_eq!(ds.storage.resident(), ds.index.shards.iter().map(|s| s.size).sum::<u64>());
        assert_eq!(ds.tier_note(), None, "held whole in memory: nothing read from the store again");
    }

    #[test]
    fn copies_of_a_dataset_larger_than_half_the_memory_are_read_past_the_page_cache() {
        // A server of 64 KiB: the dataset does not fit in half of it, so its copies are not mapped but
        // read with O_DIRECT (positioned reads where the filesystem refuses it), every byte still right.
        let (local, _dirs, ds) = opened_with_direct_copies();
        let source = ds.storage.objects().unwrap().clone();
        assert!(source.direct_copies.load(Ordering::Relaxed));
        assert!((0..ds.index.shards.len() as u32).all(|n| source.mapping(n).is_none()));
        read_all_and_compare(&ds, local.path());
        assert_eq!(source.counters.gets.load(Ordering::Relaxed), 0, "a copy in the tier was read from the store");
        assert!(source.counters.tier_hit_bytes.load(Ordering::Relaxed) > 0);
        // Unaligned pieces at every offset: the aligned blocks around each are read, the piece cut out.
        let file = std::fs::read(local.path().join(&ds.index.shards[0].path)).unwrap();
        for (offset, len) in [(1u64, 1u64), (4095, 2), (4096, 4096), (5000, 9000), (file.len() as u64 - 3, 3)] {
            let got = ds.storage.read_objects(&[(0, offset, len)]).unwrap();
            assert_eq!(&got[0][..], &file[offset as usize..(offset + len) as usize], "{len} at {offset}");
        }
    }

    /// `resident=auto` with a disk tier: a dataset whose every shard the tier holds, read directly, holds
    /// what a local copy would (from the copies: no GET), and serves it from memory; one of whose copies
    /// is missing holds nothing (its memory goes to the reads of the store).
    #[test]
    fn a_dataset_the_tier_holds_whole_holds_in_memory_what_a_local_copy_would() {
        let (local, _) = crate::storage::fixtures::dataset(150, 30_001, 3);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let first = open(&store, &context(Some(tier_dir.path()), 1 << 30), index_dir.path()).index.shards[0].size;
        let ctx = context(Some(tier_dir.path()), 1 << 30);
        let ds = open_with(&store, &ctx, index_dir.path(), direct_policy(first));
        let source = ds.storage.objects().unwrap().clone();
        assert_eq!(ds.storage.resident(), first, "the first shard held, as a local copy's would be");
        assert!(source.direct_copies.load(Ordering::Relaxed), "the others still read past the page cache");
        assert_eq!(source.counters.gets.load(Ordering::Relaxed), 0, "held from the tier's copy, not the store");
        // Served as a local copy's held shard is, from its memory (the mapping bodies send from); the
        // others by the direct path.
        let held = ds.storage.mapping(0).expect("the first shard held");
        assert_eq!(held.bytes(), &std::fs::read(local.path().join(&ds.index.shards[0].path)).unwrap()[..]);
        assert!((1..ds.index.shards.len() as u32).all(|n| ds.storage.mapping(n).is_none()));
        read_all_and_compare(&ds, local.path());
        let last = source.tier_name(ds.index.shards.last().unwrap());
        drop((ds, source, ctx));

        // The last shard's copy gone from the tier: that object will be read from the store, and nothing
        // is held (not even the first shard, whose copy is there).
        std::fs::remove_file(tier_dir.path().join("objects").join(last)).unwrap();
        let ctx = context(Some(tier_dir.path()), 1 << 30);
        let ds = open_with(&store, &ctx, index_dir.path(), direct_policy(first));
        assert_eq!(ds.storage.resident(), 0);
        read_all_and_compare(&ds, local.path());
    }

    /// The direct path opens an object's copy once and keeps it open for the next reads while the tier
    /// holds it: a copy the tier lets go is let go at once, never looked at again (before, only at its
    /// next look, or after 256 lookups of others: a server whose mounts had gone held 158 evicted copies
    /// open, their disk never freed), and counted by the tier until the last body reading it is done.
    #[test]
    fn a_copy_read_directly_is_kept_open_while_the_tier_holds_it_and_let_go_with_it() {
        let (local, _dirs, ds) = opened_with_direct_copies();
        let source = ds.storage.objects().unwrap().clone();
        let first = source.direct_copy(0, 1).expect("the tier holds it");
        assert!(Arc::ptr_eq(&first, &source.direct_copy(0, 1).unwrap()), "opened again");
        assert!(source.direct_copy_held(0));
        source.direct_copy(2, 1).expect("the tier holds it");
        assert_eq!(source.open_copies.len(), 2);
        let tier = source.tier().unwrap().clone();
        tier.remove(&source.tier_name(&ds.index.shards[0]), "test: its copy leaves");
        assert_eq!(source.open_copies.len(), 1, "kept past its copy's removal");
        let size = tier.on_disk(ds.index.shards[0].size);
        assert_eq!(tier.gone_bytes(), size, "its disk not counted while a body reads it");
        assert!(source.direct_copy(0, 1).is_none() && !source.direct_copy_held(0));
        drop(first);
        assert_eq!(tier.gone_bytes(), 0, "its disk counted after its last body");
        tier.remove(&source.tier_name(&ds.index.shards[2]), "test: leaves, never read again");
        assert_eq!(source.open_copies.len(), 0, "a copy gone from the tier still held open");
        assert_eq!(tier.gone_bytes(), 0);
        read_all_and_compare(&ds, local.path());
        assert!(source.counters.gets.load(Ordering::Relaxed) > 0, "the copies gone were read from the store");
    }

    #[test]
    fn reading_ahead_leaves_what_the_tier_holds_to_its_body_and_brings_the_rest_into_the_block_cache() {
        let whole = |ds: &Dataset| -> Vec<(u32, u64, u64)> {
            ds.index.shards.iter().enumerate().map(|(n, s)| (n as u32, 0, s.size)).collect()
        };
        // Every object's copy in the tier: a batch read ahead reads none of them. Before, each was read
        // into memory and dropped, and its body read it again (the tier read twice, and the server's
        // memory grew by the batches read ahead).
        let (local, _dirs, ds) = opened_with_direct_copies();
        let source = ds.storage.objects().unwrap().clone();
        let hits = source.counters.tier_hit_bytes.load(Ordering::Relaxed);
        ds.storage.warm_all(&whole(&ds)).unwrap();
        assert_eq!(source.counters.tier_hit_bytes.load(Ordering::Relaxed), hits, "a copy was read ahead");
        assert_eq!((source.counters.gets.load(Ordering::Relaxed), source.context.cache.bytes()), (0, 0));
        read_all_and_compare(&ds, local.path());

        // No tier: read ahead by GETs into the block cache, from which the bodies are then served.
        let (ds, _index_dir) = opened_by_gets(local.path());
        let source = ds.storage.objects().unwrap().clone();
        let before = source.counters.gets.load(Ordering::Relaxed);
        ds.storage.warm_all(&whole(&ds)).unwrap();
        let after = source.counters.gets.load(Ordering::Relaxed);
        assert!(after > before && source.context.cache.bytes() > 0, "nothing read ahead");
        read_all_and_compare(&ds, local.path());
        assert_eq!(source.counters.gets.load(Ordering::Relaxed), after, "a body read by GET what was read ahead");
    }

    #[test]
    fn bodies_read_copies_past_the_page_cache_by_the_direct_path_of_local_shards() {
        use http_body_util::BodyExt;
        let (local, _dirs, ds) = opened_with_direct_copies();
        let source = ds.storage.objects().unwrap().clone();
        let files: Vec<Vec<u8>> =
            ds.index.shards.iter().map(|s| std::fs::read(local.path().join(&s.path)).unwrap()).collect();
        // Unaligned pieces of every object, interleaved, with framing between them, as a batch's body is.
        let (mut segments, mut want, mut data) = (Vec::new(), Vec::new(), 0);
        for k in 0..60u64 {
            let n = (k % files.len() as u64) as usize;
            let size = files[n].len() as u64;
            let offset = (k * 7919 + 13) % (size - 1);
            let len = ((k * 104_729) % 150_000 + 1).min(size - offset);
            segments.push(batchfs::encode::Segment::Data { shard: n as u32, offset, len });
            want.extend_from_slice(&files[n][offset as usize..(offset + len) as usize]);
            segments.push(batchfs::encode::Segment::Inline(vec![k as u8; 17]));
            want.extend_from_slice(&[k as u8; 17]);
            data += len;
        }
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let body = |segments: Vec<batchfs::encode::Segment>| {
            let metrics = Arc::new(crate::metrics::Metrics::default());
            let stream = Arc::new(crate::body::StreamContext::new(4, 65_536, 2, metrics));
            let body = crate::body::SegmentBody::new(stream, ds.storage.clone(), segments);
            runtime.block_on(async { body.collect().await.unwrap().to_bytes() })
        };
        let (gets, direct) = (&source.counters.gets, &source.counters.tier_direct_bytes);
        assert!(body(segments.clone())[..] == want[..], "the bytes differ");
        assert_eq!(gets.load(Ordering::Relaxed), 0, "a copy in the tier was read from the store");
        assert_eq!(direct.load(Ordering::Relaxed), data, "every piece by the direct path");
        // A copy gone from the tier (evicted, or failed): its pieces are read from the store, every byte
        // still right, the others still by the direct path.
        source.direct_copy_failed(0, &std::io::Error::other("gone"));
        assert!(body(segments)[..] == want[..], "the bytes differ");
        assert!(gets.load(Ordering::Relaxed) > 0);
        assert!(direct.load(Ordering::Relaxed) > data);
    }

    /// After a restart, the copies found in the tier are checked against the index before a byte of them
    /// is served, each once, and never on a runtime worker: a body on a current-thread runtime (whose one
    /// worker is this thread) leaves each unchecked copy to a read on the blocking pool, which checks it in
    /// 4 MiB pieces; its next reads are mapped (or read directly). One copy changed on the disk in its
    /// second chunk is never served: removed, its object read from the store. Before, `mapping` and
    /// `direct_copy` read each copy whole into one buffer (gigabytes, for an LMDB) and checked it inside
    /// `poll_frame`, on the worker, again in every body that reached it before the first was done.
    #[test]
    fn copies_found_at_start_are_checked_once_and_off_the_workers_before_a_body_serves_them() {
        use batchfs::index::CHUNK_BYTES;
        use http_body_util::BodyExt;
        // Shards of about 6 MiB: two chunks each.
        let (local, _) = crate::storage::fixtures::dataset(40, 300_000, 2);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        for direct in [false, true] {
            let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let first = open(&store, &context(Some(tier_dir.path()), 1 << 30), index_dir.path());
            let (shards, sizes) = (first.index.shards.clone(), first.index.shards.iter().map(|s| s.size));
            assert!(sizes.clone().all(|size| size > CHUNK_BYTES), "copies of more than one chunk");
            let bad = first.storage.objects().unwrap().tier_name(&shards[0]);
            drop(first);
            let path = tier_dir.path().join("objects").join(&bad);
            let mut changed = std::fs::read(&path).unwrap();
            changed[CHUNK_BYTES as usize + 5] ^= 1;
            std::fs::write(&path, changed).unwrap();

            let ctx = context(Some(tier_dir.path()), 1 << 30);
            let ds = match direct {
                true => open_with(&store, &ctx, index_dir.path(), direct_policy(0)),
                false => open(&store, &ctx, index_dir.path()),
            };
            let (source, tier) = (ds.storage.objects().unwrap().clone(), ctx.tier.clone().unwrap());
            assert_eq!(source.direct_copies.load(Ordering::Relaxed), direct);
            assert!(shards.iter().all(|s| tier.is_unchecked(&source.tier_name(s))));
            let whole: Vec<Vec<u8>> =
                shards.iter().map(|s| std::fs::read(local.path().join(&s.path)).unwrap()).collect();
            // Each object in pieces of 1 MiB, interleaved, with framing between them.
            let (mut segments, mut want) = (Vec::new(), Vec::new());
            for at in (0..whole.iter().map(Vec::len).max().unwrap()).step_by(1 << 20) {
                for (n, bytes) in whole.iter().enumerate().filter(|(_, b)| at < b.len()) {
                    let len = (bytes.len() - at).min(1 << 20);
                    segments.push(batchfs::encode::Segment::Data {
                        shard: n as u32,
                        offset: at as u64,
                        len: len as u64,
                    });
                    want.extend_from_slice(&bytes[at..at + len]);
                    segments.push(batchfs::encode::Segment::Inline(vec![n as u8; 9]));
                    want.extend_from_slice(&[n as u8; 9]);
                }
            }
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let stream = Arc::new(crate::body::StreamContext::new(4, 65_536, 2, Arc::new(Default::default())));
            let body = |segments| crate::body::SegmentBody::new(stream.clone(), ds.storage.clone(), segments);
            // Three bodies at once, all reaching every unchecked copy.
            let got = runtime.block_on(async {
                let read = |b: crate::body::SegmentBody| async { b.collect().await.unwrap().to_bytes() };
                futures_util::future::join3(
                    read(body(segments.clone())),
                    read(body(segments.clone())),
                    read(body(segments.clone())),
                )
                .await
            });
            assert!([got.0, got.1, got.2].iter().all(|g| g[..] == want[..]), "direct {direct}: the bytes differ");
            let checkers = tier.checked_by.lock().unwrap().clone();
            assert_eq!(checkers.len(), shards.len(), "direct {direct}: each copy checked once");
            assert!(!checkers.contains(&std::thread::current().id()), "direct {direct}: a copy checked on the worker");
            assert_eq!(tier.counters.failures.load(Ordering::Relaxed), 1, "direct {direct}: the changed copy removed");
            assert!(!path.exists() || !tier.is_unchecked(&bad));
            assert!(
                source.counters.gets.load(Ordering::Relaxed) > 0,
                "direct {direct}: its object read from the store"
            );
            assert!(shards[1..].iter().all(|s| !tier.is_unchecked(&source.tier_name(s))));
            // Checked now: read as copies are, mapped or by the direct path, without a check again.
            let again = runtime.block_on(async { body(segments.clone()).collect().await.unwrap().to_bytes() });
            assert!(again[..] == want[..], "direct {direct}: the bytes differ");
            assert_eq!(tier.checked_by.lock().unwrap().len(), shards.len(), "direct {direct}: checked again");
            match direct {
                true => assert!(source.counters.tier_direct_bytes.load(Ordering::Relaxed) > 0),
                false => assert!(source.mapping(1).is_some(), "the checked copy is mapped"),
            }
            // ... and copied in again, before the tier's directory goes.
            wait_for("the copy made again", || tier.copies() == shards.len() && source.stager_idle());
        }
    }

    /// A store whose ranged GETs answer in pieces of 5,000 bytes, the first `flips` of them with one byte
    /// of their body changed and the next `cuts` cut off halfway by an error, as a network may. With
    /// `held` set, the next ranged GET takes it, waits until it is let go, then answers that the object
    /// changed (a failure no retry mends).
    #[derive(Debug)]
    struct Faulty {
        inner: InMemory,
        flips: std::sync::atomic::AtomicUsize,
        cuts: std::sync::atomic::AtomicUsize,
        held: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
    }

    impl Faulty {
        fn over(inner: InMemory) -> Self {
            let no = || std::sync::atomic::AtomicUsize::new(0);
            Faulty { inner, flips: no(), cuts: no(), held: Default::default() }
        }
    }

    impl std::fmt::Display for Faulty {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "Faulty({})", self.inner)
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for Faulty {
        async fn put_opts(
            &self,
            location: &object_store::path::Path,
            payload: object_store::PutPayload,
            opts: object_store::PutOptions,
        ) -> object_store::Result<object_store::PutResult> {
            self.inner.put_opts(location, payload, opts).await
        }

        async fn put_multipart_opts(
            &self,
            location: &object_store::path::Path,
            opts: object_store::PutMultipartOptions,
        ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
            self.inner.put_multipart_opts(location, opts).await
        }

        async fn get_opts(
            &self,
            location: &object_store::path::Path,
            options: object_store::GetOptions,
        ) -> object_store::Result<object_store::GetResult> {
            use futures_util::StreamExt;
            let ranged = options.range.is_some();
            let held = if ranged { self.held.lock().unwrap().take() } else { None };
            if let Some(let_go) = held {
                let _ = let_go.await;
                let source = "held, then answered as changed".into();
                return Err(object_store::Error::Precondition { path: location.to_string(), source });
            }
            let result = self.inner.get_opts(location, options).await?;
            let take = |n: &std::sync::atomic::AtomicUsize| {
                ranged && n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |k| k.checked_sub(1)).is_ok()
            };
            let flip = take(&self.flips);
            let cut = !flip && take(&self.cuts);
            let (meta, range, attributes) = (result.meta.clone(), result.range.clone(), result.attributes.clone());
            let body: Vec<bytes::Bytes> = result.into_stream().map(Result::unwrap).collect().await;
            let mut body = body.concat();
            if flip {
                let at = body.len() * 2 / 3;
                body[at] ^= 0x20;
            }
            let whole = body.len();
            let mut pieces: Vec<object_store::Result<bytes::Bytes>> =
                body.chunks(5000).map(|p| Ok(bytes::Bytes::copy_from_slice(p))).collect();
            if cut {
                pieces.truncate(pieces.len() / 2);
                pieces.push(Err(object_store::Error::Generic {
                    store: "Faulty",
                    source: format!("connection reset after {} of {whole} bytes", pieces.len() * 5000).into(),
                }));
            }
            let payload = object_store::GetResultPayload::Stream(futures_util::stream::iter(pieces).boxed());
            Ok(object_store::GetResult { payload, meta, range, attributes })
        }

        fn delete_stream(
            &self,
            locations: futures_util::stream::BoxStream<'static, object_store::Result<object_store::path::Path>>,
        ) -> futures_util::stream::BoxStream<'static, object_store::Result<object_store::path::Path>> {
            self.inner.delete_stream(locations)
        }

        fn list(
            &self,
            prefix: Option<&object_store::path::Path>,
        ) -> futures_util::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
            self.inner.list(prefix)
        }

        async fn list_with_delimiter(
            &self,
            prefix: Option<&object_store::path::Path>,
        ) -> object_store::Result<object_store::ListResult> {
            self.inner.list_with_delimiter(prefix).await
        }

        async fn copy_opts(
            &self,
            from: &object_store::path::Path,
            to: &object_store::path::Path,
            options: object_store::CopyOptions,
        ) -> object_store::Result<()> {
            self.inner.copy_opts(from, to, options).await
        }
    }

    /// An index kept by an earlier start that its objects keep differing from (built from bytes corrupted on
    /// their way, as multipart copies were taken as read): a start that holds such an object says which
    /// index to remove, instead of a bare checksum error (and, held by GETs, reads of it failing for good).
    #[test]
    fn an_index_its_objects_keep_differing_from_says_to_remove_it() {
        let (local, _) = crate::storage::fixtures::dataset(40, 20_000, 2);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let index_dir = tempfile::tempdir().unwrap();
        let ctx = context(None, 0);
        drop(open(&store, &ctx, index_dir.path()));
        let kept = index_dir.path().join("ds.batchfs-index");
        let mut index = Index::from_bytes(&std::fs::read(&kept).unwrap()).unwrap();
        index.shards[0].crc32c ^= 1;
        std::fs::write(&kept, index.to_bytes()).unwrap();
        let bucket = Bucket::of_store("s3://b/ds", store.clone() as Arc<dyn ObjectStore>, "memory").unwrap();
        let opened = ObjectSource::of_bucket(bucket, ctx.clone(), index_dir.path().to_owned(), false).unwrap();
        let io = IoPolicy {
            mode: IoMode::Auto,
            max_mapped_shards: 4096,
            memory: u64::MAX,
            resident: 1 << 30,
            resident_auto: false,
            sendfile: false,
        };
        let opening =
            Dataset::of_objects("ds", opened, Some(index_dir.path()), &IndexOptions::default(), &NoProgress, io);
        let Err(error) = opening else { panic!("opened with an index its object differs from") };
        assert!(matches!(error, crate::catalog::CatalogError::IndexDisagrees { .. }), "{error}");
        let said = error.to_string();
        assert!(said.contains(&format!("remove {}", kept.display())), "{said}");
    }

    /// GETs made again are each counted, and logged once per [`RETRY_LOG_EVERY`] (a store failing every
    /// GET logged each at debug only was silent at the default level).
    #[test]
    fn retried_gets_are_counted_and_logged_at_most_once_in_a_while() {
        let counters = ObjectCounters::default();
        assert!(counters.retried("s3://b/ds", &"timed out"));
        assert!(!counters.retried("s3://b/ds", &"timed out"));
        assert_eq!(counters.retried_gets.load(Ordering::Relaxed), 2);
        counters.retries_logged.0.lock().unwrap().0 = std::time::Instant::now().checked_sub(RETRY_LOG_EVERY);
        assert!(counters.retried("s3://b/ds", &"reset"), "logged again once the interval passed");
        // Reads given up after object_retry_for: counted, logged as seldom.
        assert!(counters.gave_up("s3://b/ds", &"no answer within object_retry_for"));
        assert!(!counters.gave_up("s3://b/ds", &"no answer within object_retry_for"));
        assert_eq!(counters.failed_reads.load(Ordering::Relaxed), 2);
        // Any repeated warning (a full disk's lost copies): said once a while, with how many were held back.
        let log = Throttled::default();
        assert_eq!((log.pass(), log.pass(), log.pass()), (Some(0), None, None));
        log.0.lock().unwrap().0 = std::time::Instant::now().checked_sub(RETRY_LOG_EVERY);
        assert_eq!((log.pass(), log.pass()), (Some(2), None));
    }

    /// A fetch that fails leaves in the block cache the entry another body put there for the same unit
    /// after its own was evicted: that body's checked bytes stay cached, and the next read of the unit is
    /// a hit. (It removed the entry by key, whoever's it was, and the unit was read again.)
    #[test]
    fn a_failed_fetch_leaves_the_entry_another_body_made_for_its_unit() {
        let (local, index) = crate::storage::fixtures::dataset(40, 20_000, 2);
        let store = Arc::new(Faulty::over(InMemory::new()));
        upload(&store.inner, local.path(), "ds");
        // Each object's first record, a frame of 16 bytes around its data: the units read below.
        let first_frame = |n: usize| {
            let shard = std::fs::read(local.path().join(&index.shards[n].path)).unwrap();
            16 + u64::from_le_bytes(shard[..8].try_into().unwrap())
        };
        let (u, v) = (first_frame(0), first_frame(1));
        // A cache that holds one of the two units, not both.
        let limits = ObjectLimits { cache: u + v - 1, ..ObjectLimits::of(&ServerLimits::default(), 1 << 40) };
        let ctx = ObjectContext::with(limits, None);
        let index_dir = tempfile::tempdir().unwrap();
        let ds = open(&store, &ctx, index_dir.path());
        let source = ds.storage.objects().unwrap().clone();
        let (unit_u, unit_v) = ([(0u32, 0u64, 1u64)], [(1u32, 0u64, 1u64)]);
        let (let_go, held) = tokio::sync::oneshot::channel();
        *store.held.lock().unwrap() = Some(held);
        std::thread::scope(|s| {
            // A: its GET of U held.
            let a = s.spawn(|| source.read_many(&unit_u));
            wait_for("A's GET to be held", || store.held.lock().unwrap().is_none());
            // V read: U's entry (A's, being fetched) is evicted. U read again: an entry of its own, fetched.
            source.read_many(&unit_v).unwrap();
            let b = source.read_many(&unit_u).unwrap();
            assert_eq!(b[0][..], std::fs::read(local.path().join(&index.shards[0].path)).unwrap()[..1]);
            // A's GET fails now.
            let_go.send(()).unwrap();
            assert!(a.join().unwrap().is_err(), "A's fetch failed");
        });
        let gets = source.counters.gets.load(Ordering::Relaxed);
        source.read_many(&unit_u).unwrap();
        assert_eq!(source.counters.gets.load(Ordering::Relaxed), gets, "U was read again: its entry was lost");
    }

    /// Units one GET reads together (coalesced, with the bytes between them) each get bytes of their own:
    /// a slice of the GET's buffer kept all of it alive for as long as the block cache held the unit, so
    /// the cache could hold several times the `object_cache` bytes it counted.
    #[test]
    fn units_read_by_one_get_hold_only_their_own_bytes() {
        let (local, _) = crate::storage::fixtures::dataset(40, 20_000, 2);
        let (ds, _index_dir) = opened_by_gets(local.path());
        let source = ds.storage.objects().unwrap().clone();
        // Two samples of object 0 with a third between them: one read, the third's bytes its gap.
        let mut parts: Vec<_> = ds.index.samples.iter().map(|s| s.parts[0].clone()).filter(|p| p.shard == 0).collect();
        parts.sort_by_key(|p| p.offset);
        let mut wanted = source.units(0, parts[0].offset, parts[0].len);
        wanted.extend(source.units(0, parts[2].offset, parts[2].len));
        let reads = units::coalesce(&wanted, source.limits().gap, source.limits().part);
        assert_eq!(reads.len(), 1, "the two samples are read by one GET");
        assert!(reads[0].len > wanted.iter().map(|u| u.len).sum::<u64>(), "with the bytes between them");
        let got = source.context.block_here(source.fetch(&reads[0], &wanted)).unwrap();
        assert_eq!(got.len(), wanted.len());
        for (unit, bytes) in wanted.iter().zip(got) {
            assert_eq!(bytes.len() as u64, unit.len);
            assert!(bytes.is_unique(), "the unit at {} shares the GET's buffer", unit.offset);
        }
    }

    /// A store that stops answering (frozen): the first GET takes all of `object_retry_for`, and the read
    /// fails counted, not as nothing at all.
    #[test]
    fn a_read_of_a_store_that_stopped_answering_fails_counted() {
        let (local, _) = crate::storage::fixtures::dataset(40, 20_000, 2);
        let memory = InMemory::new();
        upload(&memory, local.path(), "ds");
        let store = Arc::new(ThrottledStore::new(memory, ThrottleConfig::default()));
        let index_dir = tempfile::tempdir().unwrap();
        let limits = ServerLimits { object_retry_for: Duration::from_millis(300), ..Default::default() };
        let ds = open(&store, &ObjectContext::new(&limits).unwrap(), index_dir.path());
        store.config_mut(|c| c.wait_get_per_call = Duration::from_secs(60));
        let source = ds.storage.objects().unwrap().clone();
        assert!(ds.storage.read_objects(&[(0, 0, 100)]).is_err());
        assert_eq!(source.counters.failed_reads.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn copies_are_written_as_their_bodies_arrive_and_a_changed_or_cut_body_is_copied_again() {
        // Shards of about 8 MB: several 4 MiB chunks, each checked, in one part.
        let (local, _) = crate::storage::fixtures::dataset(400, 40_000, 2);
        // Through the page cache (a dataset that fits in half the server's memory), then past it (one
        // that does not: its copies are read with O_DIRECT, and written so).
        for memory in [u64::MAX, 64 << 10] {
            let inner = InMemory::new();
            upload(&inner, local.path(), "ds");
            let store = Arc::new(Faulty::over(inner));
            let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            // Indexed by a server without a tier; then one with a tier copies every object by the stager.
            drop(open(&store, &context(None, 0), index_dir.path()));
            store.flips.store(2, Ordering::SeqCst);
            store.cuts.store(2, Ordering::SeqCst);
            let ctx = context(Some(tier_dir.path()), 1 << 30);
            let io = IoPolicy {
                mode: IoMode::Auto,
                max_mapped_shards: 4096,
                memory,
                resident: 0,
                resident_auto: false,
                sendfile: false,
            };
            let ds = open_with(&store, &ctx, index_dir.path(), io);
            let source = ds.storage.objects().unwrap().clone();
            let direct = source.direct_copies.load(Ordering::Relaxed);
            assert_eq!(direct, memory != u64::MAX);
            let tier = ctx.tier.clone().unwrap();
            wait_for("every object copied", || tier.copies() == ds.index.shards.len() && source.stager_idle());
            let faults = store.flips.load(Ordering::SeqCst) + store.cuts.load(Ordering::SeqCst);
            assert_eq!(faults, 0, "every fault met");
            // The changed bodies failed their chunk's check and were copied again; the cut ones asked again.
            assert_eq!(source.counters.bad_checksums.load(Ordering::Relaxed), 2);
            assert_eq!(source.counters.retried_gets.load(Ordering::Relaxed), 2);
            for shard in &ds.index.shards {
                let (copy, _) = tier.get(&source.tier_name(shard)).unwrap();
                // Written past the page cache, no page of the copy is in it.
                let map = batchfs::mmap::MappedFile::open(&copy).unwrap();
                let cached = (0..shard.size).step_by(4096).filter(|&at| map.is_resident(at, 1)).count();
                assert!(!direct || cached == 0, "{cached} pages of a copy written with O_DIRECT in the page cache");
                drop(map);
                let want = std::fs::read(local.path().join(&shard.path)).unwrap();
                assert!(std::fs::read(copy).unwrap() == want, "the copy of {} is its object", shard.path);
            }
            let gets = source.counters.gets.load(Ordering::Relaxed);
            read_all_and_compare(&ds, local.path());
            assert_eq!(source.counters.gets.load(Ordering::Relaxed), gets, "read from the copies");
        }
    }

    #[test]
    fn an_object_rewritten_in_the_bucket_is_never_served_from_its_old_copy() {
        let (local, _) = crate::storage::fixtures::dataset(120, 30_000, 3);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let ctx = context(Some(tier_dir.path()), 1 << 30);
        let ds = open(&store, &ctx, index_dir.path());
        read_all_and_compare(&ds, local.path());
        let copies = ctx.tier.as_ref().unwrap().copies();
        // Another dataset's bytes written over the first shard: a new ETag. A restart re-indexes it and
        // reads the new bytes, not the copy of the old ones.
        let (other, other_index) = crate::storage::fixtures::dataset(50, 20_000, 1);
        let name = ds.index.shards[0].path.clone();
        let first = local.path().join(&name);
        std::fs::copy(other.path().join(&other_index.shards[0].path), &first).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(store.put(&format!("ds/{name}").into(), std::fs::read(&first).unwrap().into())).unwrap();
        drop(ds);
        let ds = open(&store, &ctx, index_dir.path());
        read_all_and_compare(&ds, local.path());
        // The new copy replaced the old one: as many copies as before.
        let tier = ctx.tier.as_ref().unwrap();
        wait_for("the new copy", || tier.copies() == copies);
        let store_meta = runtime.block_on(store.head(&format!("ds/{name}").into())).unwrap();
        let n = ds.index.shards.iter().position(|s| s.path == name).unwrap();
        assert_eq!(ds.index.shards[n].etag, store_meta.e_tag.unwrap());
    }

    #[test]
    fn without_a_tier_or_beyond_it_reads_are_gets_through_the_block_cache() {
        let (local, _) = crate::storage::fixtures::dataset(200, 30_000, 4);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let index_dir = tempfile::tempdir().unwrap();
        let (small, smaller) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let shards = open(&store, &context(None, 0), index_dir.path()).index.shards.clone();
        let total: u64 = shards.iter().map(|s| s.size).sum();
        let largest = shards.iter().map(|s| s.size).max().unwrap();
        assert!(3 * largest < total - 1, "a tier short of the dataset holds blocks of whole objects");
        // No tier; one short of the dataset (blocks of whole objects fit); one smaller than any block of them.
        let cases = [(context(None, 0), "--disk-cache"), (context(Some(small.path()), total - 1), "shuffle=blocks")];
        let cases = cases.into_iter().chain([(context(Some(smaller.path()), 1000), "--disk-cache-size")]);
        for (ctx, advice) in cases {
            let ds = open(&store, &ctx, index_dir.path());
            let source = ds.storage.objects().unwrap().clone();
            let before = source.counters.gets.load(Ordering::Relaxed);
            read_all_and_compare(&ds, local.path());
            assert!(
                ctx.tier.as_ref().is_some_and(|t| t.cap() > 1000)
                    || source.counters.gets.load(Ordering::Relaxed) > before
            );
            // Each says so, and what to do: no tier at all, and memory holding none of it; a tier too small,
            // read with `shuffle=global`; a tier smaller than what a block holds, which `blocks` cannot mend.
            let note = ds.tier_note().expect("the server says the store is read every epoch");
            assert!(note.contains(advice), "{note}");
            // Read again: from the block cache, no GET.
            let before = source.counters.gets.load(Ordering::Relaxed);
            read_all_and_compare(&ds, local.path());
            assert_eq!(source.counters.gets.load(Ordering::Relaxed), before);
        }
    }

    /// A dataset of 120 records in `shards` objects in a bucket, opened by a server whose tier (1 MiB) is
    /// smaller than it: nothing is copied as the dataset opens. The directories live as long as it.
    struct SmallTier {
        ds: Dataset,
        source: Arc<ObjectSource>,
        _dirs: [tempfile::TempDir; 3],
    }

    fn small_tier(shards: u32) -> SmallTier {
        let (local, _) = crate::storage::fixtures::dataset(120, 20_000, shards);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let ds = open(&store, &context(Some(tier_dir.path()), 1 << 20), index_dir.path());
        let source = ds.storage.objects().unwrap().clone();
        SmallTier { ds, source, _dirs: [local, tier_dir, index_dir] }
    }

    #[test]
    fn a_body_waits_for_the_parts_of_an_object_the_stager_has_picked_and_not_begun() {
        let SmallTier { ds, source, .. } = small_tier(6);
        let n = source.pick_in_order((0..ds.index.shards.len() as u32).collect()).expect("an object to copy");
        // Picked, its copy not begun: a body that comes now (on another thread) must find it being made and
        // wait for its parts. Before, it found nothing and read them by GETs beside the copy.
        assert!(source.making_of(n).is_some(), "object {n} picked with no entry for its readers");
    }

    /// Under `shuffle=blocks` over a tier smaller than the dataset, a read far ahead of the others (a
    /// mount's window running through the next epoch at the end of one) does not move the furthest read
    /// on, and its object is not copied (its bytes are read by GETs): what the slowest reader still needs
    /// is not marked to go first, nor evicted for a copy the tier would drop before the readers came.
    /// Before, a read within two blocks moved it, and a window's reads walked it through the next epoch,
    /// the objects copied for that epoch's first batches the first evicted (the store read 1.0-1.2x an
    /// epoch). A read outside the readers' window of an object the tier lacks moves it there once nothing
    /// has been read within the window for a while, never while the others read on.
    #[test]
    fn a_read_far_from_the_others_moves_the_readers_place_only_where_they_are() {
        let SmallTier { ds, source, .. } = small_tier(12);
        let order: Vec<u32> = (0..ds.index.shards.len() as u32).collect();
        let before = |p: usize| ds.index.shards[..p].iter().map(|s| s.size).sum::<u64>();
        // Blocks such that the objects at positions 4 to 7 are a block and a half: the server's defaults
        // (ahead one block, behind two).
        let block = (before(8) - before(4)) * 2 / 3;
        source.follow_unstarted(order, block, 2 * block);
        for n in 0..4 {
            source.touched(n, true);
        }
        assert_eq!(source.stager_place(), (3, 0, vec![]));
        source.touched(8, false);
        assert_eq!(source.stager_place(), (3, 0, vec![]), "a read a block and a half ahead moved or copied");
        // The next object moves it, as ever; one behind it, not in the tier, is copied first.
        source.touched(4, true);
        assert_eq!(source.stager_place(), (4, 0, vec![]));
        source.touched(1, false);
        assert_eq!(source.stager_place(), (4, 0, vec![1]));
        // On to position 10, a block at a time: what lies two blocks behind is the tier's first to go.
        for n in [6, 8, 10] {
            source.touched(n, true);
        }
        let (cursor, done, _) = source.stager_place();
        assert_eq!(cursor, 10);
        assert!(done > 2, "{done} objects evicted first");
        // A read of position 2, not in the tier, while the readers read at 10: a straggler, copied first.
        source.touched(2, false);
        assert_eq!(source.stager_place(), (10, done, vec![1, 2]));
        // Once nothing is read near 10 for a while, such a read is where the readers are now (a fresh
        // mount reading what the last one read ahead of and dropped), and the stager follows them there,
        // back or on. Before, every object they read next lay outside its window, each copied as a body
        // waited for it, none ahead.
        std::thread::sleep(stage::READERS_GONE + Duration::from_millis(50));
        source.touched(3, false);
        let (cursor, back, urgent) = source.stager_place();
        assert_eq!((cursor, urgent), (3, vec![1, 2, 3]), "not back where the readers are");
        assert!(back <= 3);
        std::thread::sleep(stage::READERS_GONE + Duration::from_millis(50));
        source.touched(11, false);
        assert_eq!(source.stager_place().0, 11, "not on where the readers are");
    }

    #[test]
    fn blocks_copy_each_object_once_per_epoch_within_a_tier_smaller_than_the_dataset() {
        let (local, _) = crate::storage::fixtures::dataset(1200, 20_000, 12);
        let memory = Arc::new(InMemory::new());
        upload(&memory, local.path(), "ds");
        // A store that takes its time, as a real one does: bodies come while objects are being copied.
        let slow = ThrottleConfig {
            wait_get_per_call: Duration::from_millis(5),
            wait_get_per_byte: Duration::from_nanos(50),
            ..Default::default()
        };
        let store = Arc::new(ThrottledStore::new(memory, slow));
        let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let total: u64 = std::fs::read_dir(local.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
            .map(|p| std::fs::metadata(p).unwrap().len())
            .sum();
        // Objects larger than a part are copied by ranged GETs into the tier while indexing (and linked
        // under their own names for the indexer).
        let limits = ServerLimits {
            disk_cache: crate::policy::TierDir(Some(tier_dir.path().to_owned())),
            disk_cache_size: AutoSize::Bytes(total / 2),
            object_part: 64 << 10,
            ..Default::default()
        };
        let ctx = ObjectContext::new(&limits).unwrap();
        let tier = ctx.tier.clone().unwrap();
        let ds = open(&store, &ctx, index_dir.path());
        assert!(tier.bytes() <= tier.cap() && tier.copies() > 0);
        assert!(ds.tier_note().unwrap().contains("shuffle=blocks"));
        // A block larger than a third of the tier is said to cost reads of the store; the default is not.
        assert!(ds.blocks_note(ds.default_block_bytes()).is_none());
        assert!(ds.blocks_note(tier.cap() / 3).is_none());
        let note = ds.blocks_note(tier.cap() / 3 + 1).unwrap();
        assert!(note.contains("more than a third of the disk tier"), "{note}");
        let source = ds.storage.objects().unwrap().clone();
        let query = batchfs::api::BatchQuery::parse("shuffle=blocks&batch_size=32").unwrap();
        for epoch in 0..2 {
            let fetched = tier.counters.fetched_bytes.load(Ordering::Relaxed);
            let read = source.counters.bytes.load(Ordering::Relaxed);
            let manifest: batchfs::api::Manifest =
                serde_json::from_slice(&ds.manifest(epoch, &query).unwrap()).unwrap();
            assert_eq!(manifest.options.block_bytes, tier.cap() / 4, "the server's default");
            let plan = ds.plan(epoch, &query).unwrap();
            // The first batch's layout, as a body asks for it: the tier follows the plan being read.
            ds.layout(epoch, 0, &query, &mut |_| true).unwrap().0.unwrap();
            // Each batch's samples read at once, as a body's chunk reads them, eight batches at a time, as a
            // mount's window asks for them; halfway, a loader opening the next epoch asks for the DALI index
            // of each of its batches (DALI builds its pipeline so): the tier goes on following the plan
            // whose bodies are read.
            let batches: Vec<&[u32]> = plan.order().chunks(32).collect();
            for (w, window) in batches.chunks(8).enumerate() {
                if w == batches.len() / 16 {
                    let idx = batchfs::api::BatchQuery { format: batchfs::encode::BatchFormat::TfrecordIdx, ..query };
                    for b in 0..batches.len() as u64 {
                        ds.layout(epoch + 1, b, &idx, &mut |_| true).unwrap().0.unwrap();
                    }
                }
                std::thread::scope(|scope| {
                    for batch in window {
                        let (ds, local) = (&ds, local.path());
                        scope.spawn(move || {
                            let parts: Vec<_> =
                                batch.iter().map(|&s| ds.index.samples[s as usize].parts[0].clone()).collect();
                            let wanted: Vec<(u32, u64, u64)> =
                                parts.iter().map(|p| (p.shard, p.offset, p.len)).collect();
                            let got = ds.storage.read_objects(&wanted).unwrap();
                            for (part, got) in parts.iter().zip(got) {
                                let file =
                                    std::fs::read(local.join(&ds.index.shards[part.shard as usize].path)).unwrap();
                                assert_eq!(&got[..], &file[part.offset as usize..(part.offset + part.len) as usize]);
                            }
                        });
                    }
                });
                assert!(tier.bytes() <= tier.cap());
            }
            // Each object is copied at most once an epoch: the stager never evicts what the block reads.
            wait_for("the stager to settle", || source.stager_idle());
            let copied = tier.counters.fetched_bytes.load(Ordering::Relaxed) - fetched;
            assert!(copied <= total, "epoch {epoch}: {copied} bytes copied of a {total}-byte dataset");
            assert!(copied > 0, "epoch {epoch}: the stager copied nothing");
            // Bodies read the objects being copied from their parts as they land, asked for first, not by
            // GETs of their own: the store is read about once an epoch (every body by GETs was 1.4x, the
            // parts not on their way yet by GETs 1.12x).
            let from_store = source.counters.bytes.load(Ordering::Relaxed) - read;
            assert!(from_store <= total + total / 4, "epoch {epoch}: {from_store} bytes read from the store");
            // What bodies read by GETs beside the copies (printed): none in a quiet run; a copy that lands while
            // a body looks at its object, or one the stager has picked and not begun, made them read it
            // (1.4 % of an epoch in one run of three here); under CPU contention a copy just made may be
            // evicted before a body reads it (up to 1.9 % seen), so no bound is asserted on it.
            eprintln!(
                "epoch {epoch}: {copied} of {total} bytes copied, {} read by GETs beside them, tier hits {} bytes",
                from_store.saturating_sub(copied),
                source.counters.tier_hit_bytes.load(Ordering::Relaxed)
            );
        }
    }
}
