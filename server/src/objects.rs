//! Datasets in object stores: `s3://BUCKET/PREFIX` (AWS S3 and S3-compatible stores such as SeaweedFS,
//! Ceph RGW or MinIO), through Apache `object_store`.
//!
//! **Where the settings come from.** The standard AWS environment (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`, web
//! identity through `AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`, the container and instance
//! metadata credentials), then the dataset's own `[dataset.s3]` table of the config file, whose keys are
//! `object_store`'s (`endpoint`, `region`, `access_key_id`, `allow_http`, ...).
//!
//! **Indexing** lists the prefix (names, sizes, ETags, last-modified: the index records them, and a
//! listing that differs rebuilds it), then reads each object once: one larger than `object_part` by
//! ranged GETs of that size, 8 at once, into a file staged on local disk that the format's indexer reads
//! like a local shard (an LMDB environment is opened by LMDB itself, so it must be a file; the copy is
//! removed as soon as the object is indexed), smaller ones (a file tree's) many at once, in memory. A
//! copy is checked against the object's ETag where that is its MD5. The index is kept in `index_dir`
//! and, with `index_in_bucket`, beside the data as `PREFIX/.batchfs-index`.
//!
//! **Held in memory.** Whole objects within the server's `resident` budget are read once at start and
//! served from memory like mapped shards (`storage.rs`); what follows is for the others.
//!
//! **Serving** reads what a body needs by ranged GETs, each carrying `If-Match` with the indexed ETag.
//! What is fetched is always whole *units* the index can check ([`Unit`]): a sample's part, a TFRecord
//! part's whole frame, or (for the ranges of `raw/` and whatever lies outside the parts) the
//! [`CHUNK_BYTES`] chunks of the object. A body chunk ends where a unit does ([`take_of`]). Units of one
//! object that lie within `object_gap` bytes of each other are read by one GET (LMDBIO's coalescing,
//! [`coalesce`]), and every unit is checked before anything is sent or kept, so a byte the store (or the
//! network) gets wrong is refetched, never served. Checked units are kept in a block cache of
//! `object_cache` bytes shared by every object dataset of the server; a unit being fetched is waited for
//! rather than fetched twice, so two mounts reading the same epoch read the bucket once. The server's
//! readahead along the plan (`readahead_batches`) fills the same cache where it can hold it
//! ([`worth_reading_ahead`]).
//!
//! **Faults.** `object_store` retries throttling (`503 SlowDown`), `5xx`, resets and timeouts with
//! backoff for `object_retry_for`; a unit that still fails its check after [`FETCH_ATTEMPTS`] reads is an
//! error. An object whose ETag is no longer the indexed one (`412`, a different ETag or size, or gone) is
//! *changed*: its shard is refused from then on (see `storage.rs`), and a restart re-indexes it.

use crate::config::ServerLimits;
use batchfs::index::{chunk_count, Index, ShardInfo, CHUNK_BYTES};
use batchfs::source::{Files, Local};
use bytes::Bytes;
use futures_util::future::{BoxFuture, FutureExt, Shared};
use futures_util::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStore};
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::sync::Semaphore;

/// Whether a dataset path names an object store (`s3://...`) rather than a directory.
pub fn is_object_url(path: &Path) -> bool {
    path.to_str().is_some_and(|s| s.starts_with("s3://") || s.starts_with("s3a://"))
}

/// Why an object dataset cannot be opened: each says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("{url}: expected s3://BUCKET or s3://BUCKET/PREFIX")]
    BadUrl { url: String },
    #[error("{url}: unknown setting {key:?} in [dataset.s3] (object_store's S3 keys: endpoint, region, ...)")]
    BadSetting { url: String, key: String },
    #[error("{url}: {message}")]
    Config { url: String, message: String },
    #[error("{url}: bucket {bucket:?} does not exist at {endpoint} ({source})")]
    NoBucket { url: String, bucket: String, endpoint: String, source: Box<object_store::Error> },
    #[error(
        "{url}: access denied at {endpoint}: check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, \
         AWS_SESSION_TOKEN) and that they may list and read the bucket ({source})"
    )]
    Denied { url: String, endpoint: String, source: Box<object_store::Error> },
    #[error("{url}: cannot reach the object store at {endpoint}: check AWS_ENDPOINT_URL and the network ({source})")]
    Unreachable { url: String, endpoint: String, source: Box<object_store::Error> },
    #[error("{url}: cannot list the objects ({source})")]
    List { url: String, source: Box<object_store::Error> },
    #[error("{url}: no objects under this prefix")]
    Empty { url: String },
}

/// Where an object dataset is and how to read it.
pub struct ObjectsAt<'a> {
    /// `s3://BUCKET/PREFIX`.
    pub url: &'a str,
    /// The `[dataset.s3]` settings, over the `AWS_*` environment.
    pub settings: &'a BTreeMap<String, String>,
    pub limits: ObjectLimits,
    /// Keep the index beside the data too, as `PREFIX/.batchfs-index` in the bucket, and reuse it from
    /// there (a new replica then reads no sample to start).
    pub index_in_bucket: bool,
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
}

impl ObjectLimits {
    pub fn of(limits: &ServerLimits) -> Self {
        ObjectLimits {
            requests: limits.object_requests.max(1),
            cache: limits.object_cache,
            gap: limits.object_gap,
            part: limits.object_part.max(64 << 10),
            timeout: limits.object_timeout,
            retry_for: limits.object_retry_for,
        }
    }
}

/// The runtime every object request runs on: bodies and warming wait for it from the blocking pool,
/// indexing from the thread that opens the datasets, so it must not be either's.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("batchfs-objects")
            .enable_all()
            .build()
            .expect("cannot start the object store runtime")
    })
}

/// Runs `work` on the object runtime and waits for it (from any thread, runtime or not).
fn wait<T: Send + 'static>(work: impl std::future::Future<Output = T> + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    runtime().spawn(async move {
        let _ = tx.send(work.await);
    });
    rx.recv().expect("the object store runtime stopped")
}

/// Runs `work`, which may borrow from the caller, on the object runtime, in a thread of its own (the
/// caller may be in another runtime, where `block_on` is refused), and waits for it. For the reads at
/// start (indexing, holding); bodies use [`wait`], which starts no thread.
fn block_here<T: Send>(work: impl std::future::Future<Output = T> + Send) -> T {
    std::thread::scope(|s| s.spawn(|| runtime().block_on(work)).join()).expect("a read of the object store panicked")
}

/// GETs in flight to each bucket (an endpoint's), server-wide: every dataset of one bucket shares its
/// bound.
fn bucket_requests(bucket: &str, requests: usize) -> Arc<Semaphore> {
    static BUCKETS: OnceLock<Mutex<HashMap<String, Arc<Semaphore>>>> = OnceLock::new();
    let mut buckets = BUCKETS.get_or_init(Default::default).lock().expect("buckets");
    buckets.entry(bucket.to_owned()).or_insert_with(|| Arc::new(Semaphore::new(requests))).clone()
}

/// Reads of one object dataset, counted (exported per dataset at `/metrics`).
#[derive(Debug, Default)]
pub struct ObjectCounters {
    /// GET requests sent (ranged reads, indexing's among them; retries inside `object_store` not).
    pub gets: AtomicU64,
    /// Bytes read from the bucket.
    pub bytes: AtomicU64,
    /// Bytes served from the block cache (or from a fetch another body was already waiting on).
    pub cache_hit_bytes: AtomicU64,
    /// Units refetched because they failed their checksum.
    pub bad_checksums: AtomicU64,
}

/// One object of the dataset (a shard or a side file, by storage number).
struct Object {
    location: ObjectPath,
    size: u64,
    etag: String,
}

/// A range of one object whose bytes the index can check: a part (its CRC32C), a TFRecord part's whole
/// frame (its header and footer are functions of the part's length and CRC32C), or a [`CHUNK_BYTES`]
/// chunk of the object (its CRC32C).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Unit {
    pub object: u32,
    pub offset: u64,
    pub len: u64,
    pub crc32c: u32,
    /// A TFRecord frame: `crc32c` is its data's.
    pub frame: bool,
}

impl Unit {
    /// Whether `bytes` (this unit's) are what the index says.
    fn holds(&self, bytes: &[u8]) -> bool {
        use batchfs::tfrecord::{frame_footer, frame_header, FOOTER_LEN, HEADER_LEN};
        if !self.frame {
            return batchfs::crc::crc32c(bytes) == self.crc32c;
        }
        let data_len = self.len - HEADER_LEN - FOOTER_LEN;
        let (header, rest) = bytes.split_at(HEADER_LEN as usize);
        let (data, footer) = rest.split_at(data_len as usize);
        header == frame_header(data_len)
            && footer == frame_footer(self.crc32c)
            && batchfs::crc::crc32c(data) == self.crc32c
    }
}

/// An object dataset: its store, its objects and the index's checksums of their units.
pub struct ObjectSource {
    url: String,
    bucket: String,
    shown: PathBuf,
    endpoint: String,
    store: Arc<dyn ObjectStore>,
    requests: Arc<Semaphore>,
    limits: ObjectLimits,
    /// Where indexing stages each object.
    stage_dir: PathBuf,
    /// The index is kept in the bucket too ([`ObjectsAt::index_in_bucket`]).
    index_in_bucket: bool,
    /// By storage number, once [`ObjectSource::attach`]ed to the index.
    objects: OnceLock<Vec<Object>>,
    /// Each shard's parts as units (TFRecord shards': their frames), sorted by offset; and every
    /// file's chunk CRCs.
    parts: OnceLock<Vec<Vec<Unit>>>,
    chunks: OnceLock<Vec<ShardInfo>>,
    /// Distinguishes this dataset's units in the server-wide cache.
    id: u64,
    pub counters: ObjectCounters,
}

/// How many times a unit is read before its failing checksum is an error.
pub const FETCH_ATTEMPTS: u32 = 8;

impl ObjectSource {
    /// Connects to the bucket of `url` and lists it, so that a wrong bucket, endpoint or credential is
    /// reported now, before anything is served. Returns the source and its objects (relative paths,
    /// sorted; hidden names left out), as [`ShardInfo`]s.
    pub fn open(at: ObjectsAt, stage_dir: PathBuf) -> Result<(ObjectSource, Vec<ShardInfo>), ObjectError> {
        let ObjectsAt { url, settings, limits, index_in_bucket } = at;
        let rest = url.strip_prefix("s3://").or_else(|| url.strip_prefix("s3a://"));
        let (bucket, prefix) = match rest {
            Some(rest) => rest.split_once('/').unwrap_or((rest, "")),
            None => return Err(ObjectError::BadUrl { url: url.to_owned() }),
        };
        if bucket.is_empty() {
            return Err(ObjectError::BadUrl { url: url.to_owned() });
        }
        let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
        let ms = |d: Duration| format!("{}ms", d.as_millis().max(1));
        builder = builder.with_config("timeout".parse().expect("a client key"), ms(limits.timeout)).with_config(
            "connect_timeout".parse().expect("a client key"),
            ms(limits.timeout.min(Duration::from_secs(10))),
        );
        for (key, value) in settings {
            let parsed: AmazonS3ConfigKey = key
                .to_ascii_lowercase()
                .parse()
                .map_err(|_| ObjectError::BadSetting { url: url.to_owned(), key: key.clone() })?;
            builder = builder.with_config(parsed, value);
        }
        let retry = object_store::RetryConfig {
            backoff: object_store::BackoffConfig::default(),
            max_retries: 10,
            retry_timeout: limits.retry_for,
        };
        builder = builder.with_retry(retry);
        let endpoint = builder
            .get_config_value(&AmazonS3ConfigKey::Endpoint)
            .unwrap_or_else(|| "the AWS endpoint of the bucket's region".to_owned());
        let store = builder.build().map_err(|e| ObjectError::Config { url: url.to_owned(), message: e.to_string() })?;
        let prefix = prefix.trim_end_matches('/');
        let source = ObjectSource {
            url: url.trim_end_matches('/').to_owned(),
            bucket: bucket.to_owned(),
            shown: PathBuf::from(url.trim_end_matches('/')),
            requests: bucket_requests(&format!("{endpoint} {bucket}"), limits.requests),
            endpoint,
            store: Arc::new(store),
            limits,
            stage_dir,
            index_in_bucket,
            objects: OnceLock::new(),
            parts: OnceLock::new(),
            chunks: OnceLock::new(),
            id: {
                static NEXT: AtomicU64 = AtomicU64::new(0);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
            counters: ObjectCounters::default(),
        };
        let listed = source.list(bucket, prefix)?;
        Ok((source, listed))
    }

    fn list(&self, bucket: &str, prefix: &str) -> Result<Vec<ShardInfo>, ObjectError> {
        let store = self.store.clone();
        let at = (!prefix.is_empty()).then(|| ObjectPath::from(prefix));
        let listed = wait(async move { store.list(at.as_ref()).try_collect::<Vec<_>>().await });
        let url = || self.url.clone();
        let endpoint = || self.endpoint.clone();
        let listed = listed.map_err(|source| {
            let text = format!("{source:?}");
            let source = Box::new(source);
            match source.as_ref() {
                object_store::Error::NotFound { .. } => {
                    ObjectError::NoBucket { url: url(), bucket: bucket.to_owned(), endpoint: endpoint(), source }
                }
                object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => {
                    ObjectError::Denied { url: url(), endpoint: endpoint(), source }
                }
                _ if text.contains("NoSuchBucket") => {
                    ObjectError::NoBucket { url: url(), bucket: bucket.to_owned(), endpoint: endpoint(), source }
                }
                _ if ["AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403 Forbidden"]
                    .iter()
                    .any(|s| text.contains(s)) =>
                {
                    ObjectError::Denied { url: url(), endpoint: endpoint(), source }
                }
                _ if ["Connect", "connection", "dns error", "timed out"].iter().any(|s| text.contains(s)) => {
                    ObjectError::Unreachable { url: url(), endpoint: endpoint(), source }
                }
                _ => ObjectError::List { url: url(), source },
            }
        })?;
        let strip = if prefix.is_empty() { 0 } else { prefix.len() + 1 };
        let mut files: Vec<ShardInfo> = listed
            .into_iter()
            .filter_map(|meta| {
                let path = meta.location.as_ref().get(strip..)?.to_owned();
                if path.is_empty() || path.split('/').any(|c| c.starts_with('.')) {
                    return None;
                }
                let mtime_ns = meta.last_modified.timestamp_nanos_opt().unwrap_or(0);
                Some(ShardInfo {
                    path,
                    size: meta.size,
                    mtime_ns,
                    etag: meta.e_tag.unwrap_or_default(),
                    ..Default::default()
                })
            })
            .collect();
        files.sort_by(|a, b| a.path.cmp(&b.path));
        if files.is_empty() {
            return Err(ObjectError::Empty { url: self.url.clone() });
        }
        Ok(files)
    }

    /// The dataset's URL, for messages.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn location(&self, path: &str) -> ObjectPath {
        let prefix = self.url.splitn(4, '/').nth(3).unwrap_or("");
        if prefix.is_empty() {
            ObjectPath::from(path)
        } else {
            ObjectPath::from(format!("{prefix}/{path}"))
        }
    }

    /// Takes the index's files (shards, then side files: the storage numbering) and the checksums of
    /// their units, for serving.
    pub fn attach(&self, index: &Index) {
        let files: Vec<ShardInfo> = index.shards.iter().chain(&index.side).cloned().collect();
        let objects = files
            .iter()
            .map(|f| Object { location: self.location(&f.path), size: f.size, etag: f.etag.clone() })
            .collect();
        let mut parts = vec![Vec::new(); index.shards.len()];
        let frames = index.format() == batchfs::index::SourceFormat::Tfrecord;
        for part in index.samples.iter().flat_map(|s| &s.parts) {
            let (offset, len) = match frames {
                true => (part.offset - batchfs::tfrecord::HEADER_LEN, batchfs::tfrecord::frame_len(part.len)),
                false => (part.offset, part.len),
            };
            parts[part.shard as usize].push(Unit {
                object: part.shard,
                offset,
                len,
                crc32c: part.crc32c,
                frame: frames,
            });
        }
        for p in &mut parts {
            p.sort_unstable();
            p.dedup();
        }
        let _ = self.objects.set(objects);
        let _ = self.parts.set(parts);
        let _ = self.chunks.set(files);
    }

    /// Object `n`'s path shown in messages.
    pub fn path_of(&self, n: u32) -> PathBuf {
        let objects = self.objects.get().map_or(&[][..], Vec::as_slice);
        let at = |o: &Object| PathBuf::from(format!("s3://{}/{}", self.bucket, o.location));
        objects.get(n as usize).map_or_else(|| self.shown.clone(), at)
    }

    /// The units whose bytes hold `len` bytes at `offset` of object `n` ([`units_of`]).
    pub fn units(&self, n: u32, offset: u64, len: u64) -> Vec<Unit> {
        let parts = self.parts.get().and_then(|p| p.get(n as usize)).map_or(&[][..], Vec::as_slice);
        match self.chunks.get().and_then(|c| c.get(n as usize)) {
            Some(file) => units_of(parts, file, n, offset, len),
            None => Vec::new(),
        }
    }

    /// How many of the `len` bytes at `offset` of object `n` a body chunk with `room` bytes left takes:
    /// up to the last unit end that fits, so that a unit is never split between two chunks (each would
    /// fetch it whole); where none fits, nothing, or, in a chunk still `empty`, the first unit whole
    /// (a sample larger than `chunk_size` is one chunk).
    pub fn take(&self, n: u32, offset: u64, len: u64, room: u64, empty: bool) -> u64 {
        take_of(&self.units(n, offset, len), offset, len, room, empty)
    }

    /// Object `n` (`file`, as indexed) read whole into the server's own memory, by ranged GETs of
    /// `object_part` several at once, each `If-Match` its ETag, and checked against the index's CRC32C
    /// of each of its chunks (read again, up to [`FETCH_ATTEMPTS`] times, where one differs).
    pub fn hold(&self, n: u32, file: &ShardInfo) -> io::Result<batchfs::mmap::MappedFile> {
        let object = &self.objects.get().expect("attached")[n as usize];
        batchfs::mmap::MappedFile::in_memory(file.size as usize, |memory| {
            block_here(self.read_into(n, object, file, memory))
        })
    }

    async fn read_into(&self, n: u32, object: &Object, file: &ShardInfo, memory: &mut [u8]) -> io::Result<()> {
        let part = self.limits.part.div_ceil(CHUNK_BYTES).max(1) * CHUNK_BYTES;
        let mut todo = parts_of(&mut memory[..file.size as usize], part);
        for attempt in 1..=FETCH_ATTEMPTS {
            // Each CHUNK_BYTES chunk of what was read against its CRC32C from the index; a chunk that
            // differs is read again by itself.
            todo = self
                .read_parts(n, object, todo)
                .await?
                .into_iter()
                .flat_map(|(offset, slice)| parts_of(slice, CHUNK_BYTES).into_iter().map(move |(k, c)| (offset + k, c)))
                .filter(|(at, chunk)| file.chunk_crc(at / CHUNK_BYTES) != Some(batchfs::crc::crc32c(chunk)))
                .collect();
            if todo.is_empty() {
                return Ok(());
            }
            self.counters.bad_checksums.fetch_add(todo.len() as u64, Ordering::Relaxed);
            let object = &file.path;
            tracing::warn!(dataset = %self.url, %object, attempt, "ranges failed their checksums: reading them again");
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: its bytes keep differing from the index's checksums", self.path_of(n).display()),
        ))
    }

    /// Fills each `(offset, slice)` with the bytes at `offset` of `object` (storage number `n`), by one
    /// ranged GET each, up to 8 at once; returns them, filled.
    async fn read_parts<'a>(
        &self,
        n: u32,
        object: &Object,
        parts: Vec<(u64, &'a mut [u8])>,
    ) -> io::Result<Vec<(u64, &'a mut [u8])>> {
        let reads: Vec<_> = parts.into_iter().map(|(offset, slice)| self.read_part(n, object, offset, slice)).collect();
        futures_util::stream::iter(reads).buffer_unordered(self.limits.requests.clamp(1, 8)).try_collect().await
    }

    async fn read_part<'a>(
        &self,
        n: u32,
        object: &Object,
        offset: u64,
        slice: &'a mut [u8],
    ) -> io::Result<(u64, &'a mut [u8])> {
        let bytes = self.get(n, object, offset, slice.len() as u64).await.map_err(ReadError::into_io)?;
        slice.copy_from_slice(&bytes);
        Ok((offset, slice))
    }

    /// The bytes of each wanted range `(object, offset, len)`, in order, read through the cache.
    pub fn read_many(self: &Arc<Self>, wanted: &[(u32, u64, u64)]) -> Result<Vec<Bytes>, ReadError> {
        let this = self.clone();
        let wanted = wanted.to_vec();
        wait(async move { this.read_many_async(&wanted).await })
    }

    async fn read_many_async(self: &Arc<Self>, wanted: &[(u32, u64, u64)]) -> Result<Vec<Bytes>, ReadError> {
        let mut units: Vec<Unit> = wanted.iter().flat_map(|&(n, o, l)| self.units(n, o, l)).collect();
        units.sort_unstable();
        units.dedup();
        let got = cache().get_or_fetch(self, &units).await?;
        let by_unit: HashMap<Unit, Bytes> = units.into_iter().zip(got).collect();
        wanted
            .iter()
            .map(|&(n, offset, len)| {
                // The same units as above, in order: each range is cut out of its own.
                let mine = self.units(n, offset, len);
                let (end, mut at) = (offset + len, offset);
                let mut out = Vec::new();
                for unit in &mine {
                    let bytes = &by_unit[unit];
                    let (start, stop) = (at.max(unit.offset), end.min(unit.offset + unit.len));
                    if start > at {
                        break;
                    }
                    if start >= stop {
                        continue;
                    }
                    let piece = bytes.slice((start - unit.offset) as usize..(stop - unit.offset) as usize);
                    if start == offset && stop == end {
                        return Ok(piece);
                    }
                    out.extend_from_slice(&piece);
                    at = stop;
                }
                if at != end {
                    return Err(ReadError::Io(io::Error::other(format!(
                        "{}: {len} bytes at {offset} lie outside the indexed object",
                        self.path_of(n).display()
                    ))));
                }
                Ok(Bytes::from(out))
            })
            .collect()
    }

    /// Reads `read` (units of one object, coalesced) with one ranged GET, checks every unit, and returns
    /// each unit's bytes; a unit that fails its check is read again by itself, up to [`FETCH_ATTEMPTS`]
    /// reads in all.
    async fn fetch(&self, read: &Read, units: &[Unit]) -> Result<Vec<Bytes>, ReadError> {
        let object = &self.objects.get().expect("attached")[read.object as usize];
        let bytes = self.get(read.object, object, read.offset, read.len).await?;
        let mut out: Vec<Bytes> = units
            .iter()
            .map(|u| bytes.slice((u.offset - read.offset) as usize..(u.offset - read.offset + u.len) as usize))
            .collect();
        for (unit, got) in units.iter().zip(&mut out) {
            let mut attempt = 1;
            while !unit.holds(got) {
                self.counters.bad_checksums.fetch_add(1, Ordering::Relaxed);
                let why = format!(
                    "{}: {} bytes at {} do not match the index's checksum",
                    self.path_of(read.object).display(),
                    unit.len,
                    unit.offset
                );
                if attempt >= FETCH_ATTEMPTS {
                    return Err(ReadError::Io(io::Error::new(io::ErrorKind::InvalidData, why)));
                }
                tracing::warn!(dataset = %self.url, %why, attempt, "reading it again");
                attempt += 1;
                *got = self.get(read.object, object, unit.offset, unit.len).await?;
            }
        }
        Ok(out)
    }

    /// One ranged GET of `object` (storage number `n`), `If-Match` its indexed ETag. A request that fails
    /// on the way (object_store's own retries given up, or a body cut short) is made again, with backoff,
    /// while `object_retry_for` from the first attempt lasts; an object changed since it was indexed is not.
    async fn get(&self, n: u32, object: &Object, offset: u64, len: u64) -> Result<Bytes, ReadError> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        let deadline = tokio::time::Instant::now() + self.limits.retry_for;
        let mut backoff = Duration::from_millis(100);
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let result = match tokio::time::timeout(left, self.get_once(n, object, offset, len)).await {
                Ok(result) => result,
                Err(_) => Err(ReadError::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{}: no answer within object_retry_for", self.path_of(n).display()),
                ))),
            };
            match result {
                Err(ReadError::Io(e)) if tokio::time::Instant::now() + backoff < deadline => {
                    tracing::debug!(dataset = %self.url, error = %e, "a GET failed: asking again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                other => return other,
            }
        }
    }

    async fn get_once(&self, n: u32, object: &Object, offset: u64, len: u64) -> Result<Bytes, ReadError> {
        let _permit = self.requests.acquire().await.map_err(io::Error::other)?;
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        let options = GetOptions {
            range: Some(GetRange::Bounded(offset..offset + len)),
            if_match: (!object.etag.is_empty()).then(|| object.etag.clone()),
            ..Default::default()
        };
        let changed = |why: String| ReadError::Changed { shard: n, why };
        let result = match self.store.get_opts(&object.location, options).await {
            Ok(result) => result,
            Err(object_store::Error::Precondition { .. }) => {
                return Err(changed(format!("{} has a new ETag since it was indexed", self.path_of(n).display())))
            }
            Err(object_store::Error::NotFound { .. }) => {
                return Err(changed(format!("{} is gone since it was indexed", self.path_of(n).display())))
            }
            Err(e) => return Err(ReadError::Io(io::Error::other(format!("{}: {e}", self.path_of(n).display())))),
        };
        if let Some(etag) = result.meta.e_tag.as_ref().filter(|e| !object.etag.is_empty() && **e != object.etag) {
            return Err(changed(format!(
                "{} has ETag {etag}, not the indexed {} (rewritten since it was indexed)",
                self.path_of(n).display(),
                object.etag
            )));
        }
        if result.meta.size != object.size {
            return Err(changed(format!(
                "{} is {} bytes, not the indexed {}",
                self.path_of(n).display(),
                result.meta.size,
                object.size
            )));
        }
        let bytes =
            result.bytes().await.map_err(|e| io::Error::other(format!("{}: {e}", self.path_of(n).display())))?;
        self.counters.bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        if bytes.len() as u64 != len {
            return Err(ReadError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{}: {} bytes at {offset} came back for {len}", self.path_of(n).display(), bytes.len()),
            )));
        }
        Ok(bytes)
    }

    /// Copies `file` into `dir` by ranged GETs of `object_part` bytes, several at once, and checks the
    /// copy against the object's ETag where that is its MD5 (a single-part upload); a copy that does not
    /// match is made again, up to [`FETCH_ATTEMPTS`] times.
    async fn stage(&self, file: &ShardInfo, dir: &Path) -> io::Result<PathBuf> {
        let name = file.path.rsplit('/').next().unwrap_or(&file.path);
        let path = dir.join(name);
        let object = Object { location: self.location(&file.path), size: file.size, etag: file.etag.clone() };
        let out = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
        out.set_len(file.size)?;
        if file.size == 0 {
            return Ok(path);
        }
        // SAFETY: the file was made here, in a directory of our own, and nothing else writes it.
        let mut copy = unsafe { memmap2::MmapMut::map_mut(&out)? };
        for attempt in 1..=FETCH_ATTEMPTS {
            self.read_parts(u32::MAX, &object, parts_of(&mut copy, self.limits.part)).await?;
            if matches_etag(&file.etag, &copy) {
                return Ok(path);
            }
            self.counters.bad_checksums.fetch_add(1, Ordering::Relaxed);
            let object = &file.path;
            tracing::warn!(dataset = %self.url, %object, attempt, "the copy read does not match the ETag's MD5");
        }
        Err(differs_from_etag(&self.url, file))
    }
}

/// `memory` cut into `(offset, slice)` parts of `part` bytes (the last one shorter).
fn parts_of(memory: &mut [u8], part: u64) -> Vec<(u64, &mut [u8])> {
    memory.chunks_mut(part as usize).enumerate().map(|(k, slice)| (k as u64 * part, slice)).collect()
}

/// Whether `bytes` have the MD5 that `etag` is, where it is one (else nothing to check them against).
fn matches_etag(etag: &str, bytes: &[u8]) -> bool {
    use md5::Digest;
    etag_md5(etag).is_none_or(|want| md5::Md5::digest(bytes)[..] == want)
}

fn differs_from_etag(url: &str, file: &ShardInfo) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{url}/{}: every copy read differs from the object's MD5 (its ETag)", file.path),
    )
}

/// The MD5 an ETag is, where it is one (a single-part upload's: 32 hex digits, quoted).
fn etag_md5(etag: &str) -> Option<[u8; 16]> {
    let hex = etag.trim_matches('"');
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The name of the index kept beside the data in the bucket (hidden: never listed as a file).
const INDEX_OBJECT: &str = batchfs::source::INDEX_FILE_NAME;

impl Files for ObjectSource {
    fn root(&self) -> &Path {
        &self.shown
    }

    fn kept_index(&self) -> Option<Vec<u8>> {
        if !self.index_in_bucket {
            return None;
        }
        let at = self.location(INDEX_OBJECT);
        let read =
            block_here(async { object_store::ObjectStoreExt::get(self.store.as_ref(), &at).await?.bytes().await });
        match read {
            Ok(bytes) => Some(bytes.to_vec()),
            Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => {
                tracing::warn!(dataset = %self.url, error = %e, "cannot read the index kept in the bucket");
                None
            }
        }
    }

    fn keep_index(&self, index: &[u8]) -> io::Result<bool> {
        if !self.index_in_bucket {
            return Ok(false);
        }
        let (at, payload) = (self.location(INDEX_OBJECT), bytes::Bytes::copy_from_slice(index).into());
        block_here(async { object_store::ObjectStoreExt::put(self.store.as_ref(), &at, payload).await })
            .map_err(|e| io::Error::other(format!("{}/{INDEX_OBJECT}: {e}", self.url)))?;
        Ok(true)
    }

    fn local(&self, file: &ShardInfo) -> io::Result<Local> {
        std::fs::create_dir_all(&self.stage_dir)?;
        let dir = tempfile::Builder::new().prefix("batchfs-stage-").tempdir_in(&self.stage_dir)?;
        let path = block_here(self.stage(file, dir.path()))?;
        Ok(Local { path, staged: Some(Box::new(dir)) })
    }

    /// Many objects at once (`object_requests`, at most 64), each one GET, checked against its ETag's
    /// MD5 where it is one, kept in memory only until `each` has seen it. Objects larger than
    /// `object_part` are staged as [`Files::local`] does.
    fn read_each(
        &self,
        files: &[ShardInfo],
        each: &mut batchfs::source::EachFile,
    ) -> Result<(), batchfs::source::IndexError> {
        let io_err = |file: &ShardInfo| {
            let path = self.shown.join(&file.path);
            move |source| batchfs::source::IndexError::Io { path, source }
        };
        let (small, large): (Vec<usize>, Vec<usize>) =
            (0..files.len()).partition(|&i| files[i].size <= self.limits.part);
        for i in large {
            let local = self.local(&files[i]).map_err(io_err(&files[i]))?;
            let map = batchfs::mmap::MappedFile::open(&local.path).map_err(io_err(&files[i]))?;
            each(i, map.bytes())?;
        }
        let window = self.limits.requests.clamp(1, 64);
        let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, io::Result<Bytes>)>(window);
        std::thread::scope(|s| {
            // The sender moves into the thread: when the reads end, so does the loop below.
            let reads = s.spawn(move || {
                runtime().block_on(async {
                    let mut reads = futures_util::stream::iter(small)
                        .map(|i| async move { (i, self.read_whole(&files[i]).await) })
                        .buffer_unordered(window);
                    while let Some(done) = reads.next().await {
                        if tx.send(done).is_err() {
                            return;
                        }
                    }
                })
            });
            let mut result = Ok(());
            for (i, read) in rx.iter() {
                result = read.map_err(io_err(&files[i])).and_then(|bytes| each(i, &bytes));
                if result.is_err() {
                    break;
                }
            }
            drop(rx);
            reads.join().expect("the reads panicked");
            result
        })
    }
}

impl ObjectSource {
    /// All of `file` by one GET, checked against its ETag's MD5 where it is one (read again, up to
    /// [`FETCH_ATTEMPTS`] times, where it differs).
    async fn read_whole(&self, file: &ShardInfo) -> io::Result<Bytes> {
        let object = Object { location: self.location(&file.path), size: file.size, etag: file.etag.clone() };
        for _ in 0..FETCH_ATTEMPTS {
            let bytes = self.get(u32::MAX, &object, 0, file.size).await.map_err(ReadError::into_io)?;
            let etag = file.etag.clone();
            let (bytes, good) = tokio::task::spawn_blocking(move || {
                let good = matches_etag(&etag, &bytes);
                (bytes, good)
            })
            .await
            .map_err(io::Error::other)?;
            if good {
                return Ok(bytes);
            }
            self.counters.bad_checksums.fetch_add(1, Ordering::Relaxed);
        }
        Err(differs_from_etag(&self.url, file))
    }
}

/// [`ObjectSource::take`] over `units`, the units of `len` bytes at `offset`.
pub fn take_of(units: &[Unit], offset: u64, len: u64, room: u64, empty: bool) -> u64 {
    let end = offset + len;
    let mut fits = 0;
    for unit in units {
        let unit_end = (unit.offset + unit.len).min(end);
        if unit_end - offset > room {
            return if fits == 0 && empty { unit_end - offset } else { fits };
        }
        fits = unit_end - offset;
    }
    fits.max(len.min(room))
}

/// The units whose bytes hold `len` bytes at `offset` of object `n` (`file`, whose parts, or frames, are
/// `parts`, sorted): the parts it overlaps where they cover it without a gap, else the [`CHUNK_BYTES`]
/// chunks it spans.
pub fn units_of(parts: &[Unit], file: &ShardInfo, n: u32, offset: u64, len: u64) -> Vec<Unit> {
    let end = offset + len;
    let first = parts.partition_point(|u| u.offset + u.len <= offset);
    let mut covered = offset;
    let mut out = Vec::new();
    for u in &parts[first..] {
        if u.offset >= end || u.offset > covered {
            break;
        }
        covered = covered.max(u.offset + u.len);
        out.push(*u);
    }
    if covered >= end && !out.is_empty() {
        return out;
    }
    let last = chunk_count(file.size) - 1;
    let (from, past) = (offset / CHUNK_BYTES, end.div_ceil(CHUNK_BYTES).max(offset / CHUNK_BYTES + 1));
    (from..past.min(last + 1))
        .map(|k| Unit {
            object: n,
            offset: k * CHUNK_BYTES,
            len: (file.size - k * CHUNK_BYTES).min(CHUNK_BYTES),
            crc32c: file.chunk_crc(k).unwrap_or(0),
            frame: false,
        })
        .collect()
}

/// Why a read of an object dataset failed.
#[derive(Debug)]
pub enum ReadError {
    /// Object `shard` is not the one indexed: refuse it.
    Changed {
        shard: u32,
        why: String,
    },
    Io(io::Error),
}

impl ReadError {
    /// As an I/O error (a change found while reading an object whole: the listing is no longer true).
    fn into_io(self) -> io::Error {
        match self {
            ReadError::Changed { why, .. } => io::Error::other(format!("{why} (changed since it was listed)")),
            ReadError::Io(e) => e,
        }
    }
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// Units read with one GET: `units[first..past]`, all of `object`, `offset..offset + len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub object: u32,
    pub offset: u64,
    pub len: u64,
    pub first: usize,
    pub past: usize,
}

/// Merges `units` (sorted, without overlaps) into reads: consecutive units of one object at most `gap`
/// bytes apart share a read while it stays within `max` bytes (a unit longer than `max` is a read of
/// its own).
pub fn coalesce(units: &[Unit], gap: u64, max: u64) -> Vec<Read> {
    let mut reads: Vec<Read> = Vec::new();
    for (i, u) in units.iter().enumerate() {
        if let Some(r) = reads.last_mut() {
            let end = r.offset + r.len;
            if r.object == u.object && u.offset >= end && u.offset - end <= gap && u.offset + u.len - r.offset <= max {
                r.len = u.offset + u.len - r.offset;
                r.past = i + 1;
                continue;
            }
        }
        reads.push(Read { object: u.object, offset: u.offset, len: u.len, first: i, past: i + 1 });
    }
    reads
}

/// A unit's bytes, once fetched and checked (or the fetch's failure), shared by everyone waiting on it.
type Pending = Shared<BoxFuture<'static, Result<Bytes, Arc<str>>>>;

/// The block cache of object datasets: checked units by dataset and unit, least recently used
/// evicted past `object_cache` bytes. A unit being fetched is in it too, as the fetch to wait for.
struct BlockCache {
    inner: Mutex<CacheInner>,
}

struct CacheInner {
    units: lru::LruCache<(u64, Unit), (u64, Pending)>,
    bytes: u64,
    cap: u64,
}

fn cache() -> &'static BlockCache {
    CACHE.get_or_init(|| BlockCache {
        inner: Mutex::new(CacheInner { units: lru::LruCache::unbounded(), bytes: 0, cap: 1 << 30 }),
    })
}

static CACHE: OnceLock<BlockCache> = OnceLock::new();

/// Whether reading `bytes` ahead into the block cache is worth it: only while the cache can hold them
/// several times over (8), or the units read ahead would be evicted, under the bodies' own traffic,
/// before the bodies that want them come, and read twice.
pub fn worth_reading_ahead(bytes: u64) -> bool {
    bytes.saturating_mul(8) <= cache().inner.lock().expect("cache").cap
}

/// Sets the block cache's size (`object_cache`), server-wide.
pub fn set_cache_size(bytes: u64) {
    let mut inner = cache().inner.lock().expect("cache");
    inner.cap = bytes;
    inner.evict();
}

impl CacheInner {
    fn evict(&mut self) {
        while self.bytes > self.cap {
            match self.units.pop_lru() {
                Some((_, (len, _))) => self.bytes -= len,
                None => break,
            }
        }
    }
}

impl BlockCache {
    /// Each unit's bytes: from the cache, from a fetch already running, or fetched now (coalesced).
    async fn get_or_fetch(&self, source: &Arc<ObjectSource>, units: &[Unit]) -> Result<Vec<Bytes>, ReadError> {
        for round in 0..2 {
            let mut waits: Vec<Pending> = Vec::with_capacity(units.len());
            let mut senders = Vec::new();
            {
                let mut inner = self.inner.lock().expect("cache");
                for (i, u) in units.iter().enumerate() {
                    let key = (source.id, *u);
                    if let Some((_, pending)) = inner.units.get(&key) {
                        waits.push(pending.clone());
                        continue;
                    }
                    let (tx, rx) = tokio::sync::oneshot::channel::<Result<Bytes, Arc<str>>>();
                    let pending: Pending =
                        async move { rx.await.unwrap_or_else(|_| Err(Arc::from("the fetch was dropped"))) }
                            .boxed()
                            .shared();
                    inner.units.put(key, (u.len, pending.clone()));
                    inner.bytes += u.len;
                    waits.push(pending);
                    senders.push((i, tx));
                }
                inner.evict();
            }
            // Fetch what is ours, coalesced; everyone else waits on the same pending entries.
            let ours: Vec<Unit> = senders.iter().map(|(i, _)| units[*i]).collect();
            let mut senders: Vec<Option<tokio::sync::oneshot::Sender<_>>> =
                senders.into_iter().map(|(_, tx)| Some(tx)).collect();
            let reads = coalesce(&ours, source.limits.gap, source.limits.part);
            let fetched =
                futures_util::future::join_all(reads.iter().map(|r| source.fetch(r, &ours[r.first..r.past]))).await;
            let mut failure = None;
            for (read, result) in reads.iter().zip(fetched) {
                match result {
                    Ok(slices) => {
                        for (k, bytes) in (read.first..read.past).zip(slices) {
                            if let Some(tx) = senders[k].take() {
                                let _ = tx.send(Ok(bytes));
                            }
                        }
                    }
                    Err(e) => {
                        let text: Arc<str> = Arc::from(match &e {
                            ReadError::Changed { why, .. } => why.clone(),
                            ReadError::Io(e) => e.to_string(),
                        });
                        let mut inner = self.inner.lock().expect("cache");
                        for k in read.first..read.past {
                            if let Some((len, _)) = inner.units.pop(&(source.id, ours[k])) {
                                inner.bytes -= len;
                            }
                            if let Some(tx) = senders[k].take() {
                                let _ = tx.send(Err(text.clone()));
                            }
                        }
                        failure.get_or_insert(e);
                    }
                }
            }
            if let Some(e) = failure {
                return Err(e);
            }
            let mut out = Vec::with_capacity(units.len());
            let mut waited = 0u64;
            let mut retry = false;
            for pending in waits {
                match pending.await {
                    Ok(bytes) => {
                        waited += bytes.len() as u64;
                        out.push(bytes);
                    }
                    // Another body's fetch failed: fetch it ourselves (once).
                    Err(_) if round == 0 => {
                        retry = true;
                        break;
                    }
                    Err(why) => return Err(ReadError::Io(io::Error::other(why.to_string()))),
                }
            }
            if !retry {
                let fetched: u64 = ours.iter().map(|u| u.len).sum();
                source.counters.cache_hit_bytes.fetch_add(waited.saturating_sub(fetched), Ordering::Relaxed);
                return Ok(out);
            }
        }
        unreachable!("the second round returns")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn plain(spec: &[(u32, u64, u64)]) -> Vec<Unit> {
        spec.iter().map(|&(object, offset, len)| Unit { object, offset, len, crc32c: 0, frame: false }).collect()
    }

    #[test]
    fn neighbours_merge_far_ones_and_other_objects_do_not() {
        let units = plain(&[(0, 0, 10), (0, 15, 5), (0, 100, 10), (1, 110, 10), (1, 120, 10)]);
        let reads = coalesce(&units, 8, 1 << 20);
        let got: Vec<(u32, u64, u64, usize, usize)> =
            reads.iter().map(|r| (r.object, r.offset, r.len, r.first, r.past)).collect();
        assert_eq!(got, vec![(0, 0, 20, 0, 2), (0, 100, 10, 2, 3), (1, 110, 20, 3, 5)]);
        // A read never grows past `max`.
        let reads = coalesce(&units, 8, 15);
        assert_eq!(reads.len(), 5, "{reads:?}");
    }

    #[test]
    fn a_range_is_read_as_the_parts_that_cover_it_else_as_chunks() {
        let unit = |offset, len| Unit { object: 0, offset, len, crc32c: 7, frame: true };
        // Frames back to back from 0, then a gap (a skipped region), then one more frame.
        let parts = [unit(0, 100), unit(100, 50), unit(150, 200), unit(400, 10)];
        let file = ShardInfo { size: 3 * CHUNK_BYTES + 5, ..Default::default() };
        let at = |o, l| units_of(&parts, &file, 0, o, l);
        assert_eq!(at(10, 20), vec![parts[0]], "inside one frame");
        assert_eq!(at(0, 150), parts[..2].to_vec(), "two frames exactly");
        assert_eq!(at(90, 100), parts[..3].to_vec(), "across frames");
        assert_eq!(at(402, 3), vec![parts[3]]);
        // Across the gap, or past the frames: the chunks, each with its own CRC and the last one short.
        let chunks = at(300, 200);
        assert_eq!(chunks.len(), 1);
        assert_eq!((chunks[0].offset, chunks[0].len, chunks[0].frame), (0, CHUNK_BYTES, false));
        let tail = at(CHUNK_BYTES - 1, 2 * CHUNK_BYTES + 6);
        let spans: Vec<(u64, u64)> = tail.iter().map(|u| (u.offset, u.len)).collect();
        assert_eq!(
            spans,
            vec![(0, CHUNK_BYTES), (CHUNK_BYTES, CHUNK_BYTES), (2 * CHUNK_BYTES, CHUNK_BYTES), (3 * CHUNK_BYTES, 5)]
        );
    }

    #[test]
    fn a_body_chunk_ends_where_a_unit_does() {
        let unit = |offset, len| Unit { object: 0, offset, len, crc32c: 0, frame: true };
        let units = [unit(0, 100), unit(100, 300), unit(400, 50)];
        // Room for the first unit only: the chunk takes it, and the next chunk starts at a unit.
        assert_eq!(take_of(&units, 0, 450, 150, true), 100);
        assert_eq!(take_of(&units, 0, 450, 400, false), 400);
        assert_eq!(take_of(&units, 0, 450, 1000, false), 450);
        // A unit larger than a whole chunk: taken whole by an empty chunk, left by one that is not.
        assert_eq!(take_of(&units[1..], 100, 350, 50, true), 300);
        assert_eq!(take_of(&units[1..], 100, 350, 50, false), 0);
        // A segment ending inside its last unit (a range request): up to the segment's end.
        assert_eq!(take_of(&units, 0, 120, 1000, false), 120);
    }

    #[test]
    fn a_frame_holds_only_its_own_header_data_and_footer() {
        use batchfs::tfrecord::{frame_footer, frame_header};
        let data = b"an example's bytes".to_vec();
        let crc32c = batchfs::crc::crc32c(&data);
        let mut frame = frame_header(data.len() as u64).to_vec();
        frame.extend_from_slice(&data);
        frame.extend_from_slice(&frame_footer(crc32c));
        let unit = Unit { object: 0, offset: 0, len: frame.len() as u64, crc32c, frame: true };
        assert!(unit.holds(&frame));
        for i in 0..frame.len() {
            let mut flipped = frame.clone();
            flipped[i] ^= 0x10;
            assert!(!unit.holds(&flipped), "a flip at byte {i} was not caught");
        }
        let part = Unit { offset: 12, len: data.len() as u64, frame: false, ..unit };
        assert!(part.holds(&data) && !part.holds(b"other bytes of the same len"));
    }

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

    proptest! {
        /// The merged reads cover exactly the wanted units: each unit lies in the one read that lists it,
        /// reads start and end at units, stay within `max` (unless one unit is longer) and join only
        /// units of one object at most `gap` apart.
        #[test]
        fn merged_reads_cover_exactly_the_wanted_ranges(
            raw in proptest::collection::vec((0u32..3, 0u64..5000, 1u64..300), 0..60),
            gap in 0u64..400,
            max in 1u64..3000,
        ) {
            // Sorted, without overlaps, as units are.
            let mut raw = raw;
            raw.sort_unstable();
            let mut units: Vec<Unit> = Vec::new();
            for (object, offset, len) in raw {
                if units.last().is_some_and(|u| u.object == object && u.offset + u.len > offset) {
                    continue;
                }
                units.push(Unit { object, offset, len, crc32c: 0, frame: false });
            }
            let reads = coalesce(&units, gap, max);
            let mut next = 0;
            for r in &reads {
                prop_assert_eq!(r.first, next);
                prop_assert!(r.past > r.first);
                next = r.past;
                let mine = &units[r.first..r.past];
                prop_assert_eq!(r.offset, mine[0].offset);
                prop_assert_eq!(r.offset + r.len, mine[mine.len() - 1].offset + mine[mine.len() - 1].len);
                prop_assert!(r.len <= max || mine.len() == 1);
                for pair in mine.windows(2) {
                    prop_assert_eq!(pair[0].object, pair[1].object);
                    prop_assert!(pair[1].offset - (pair[0].offset + pair[0].len) <= gap);
                }
                prop_assert!(mine.iter().all(|u| u.object == r.object));
            }
            prop_assert_eq!(next, units.len());
        }
    }
}
