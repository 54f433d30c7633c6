//! The catalog: every served dataset with its index and mapped shards, plus caches of epoch plans,
//! manifests and `rolling/` slot tables (pure functions of the index and the query, so caching them is
//! always correct).

use crate::memo::Memo;
use crate::objects::tier::Tier;
use crate::objects::{ObjectSource, ObjectsAt};
use crate::storage::{IoPolicy, OpenError, Storage};
use batchfs::api::{BatchEntry, BatchQuery, DatasetInfo, FileEntry, FileList, FilesQuery, Manifest, RollingQuery};
use batchfs::encode;
use batchfs::index::{Index, ShardInfo};
use batchfs::plan::{EpochPlan, Objects, PlanError, Shuffle};
use batchfs::rolling::{RollingError, SlotTable};
use batchfs::source::{self, Files, IndexOptions, IndexOrigin, Progress};
use lru::LruCache;
use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use thiserror::Error;

mod follow;
mod samples;

/// A batch's layout as built within its budget ([`encode::Charged`]), and its samples.
pub type Layout = (encode::Charged, u32);
/// What a layout's memory is asked of as it grows ([`encode::layout_within`]).
pub type Charge<'a> = &'a mut dyn FnMut(u64) -> bool;

/// A dataset the server cannot open.
#[derive(Debug, Error)]
pub enum CatalogError {
    #[error("dataset {name}: {source}")]
    Index { name: String, source: source::IndexError },
    #[error("dataset {name}: cannot open shard {path}: {source}")]
    Map { name: String, path: PathBuf, source: std::io::Error },
    #[error("dataset {name}: a shard changed since it was indexed ({path}); restart to re-index")]
    Changed { name: String, path: PathBuf },
    #[error(
        "dataset {name}: {path}: its bytes in the store keep differing from the index loaded from {kept}: if the \
         object was not rewritten, that index was built from bytes corrupted on their way from the store (a \
         multipart upload, by a release that did not check those); remove {kept} and start again to index it \
         anew ({source})"
    )]
    IndexDisagrees { name: String, path: PathBuf, kept: String, source: std::io::Error },
    #[error("dataset {name}: {source}")]
    Beneath { name: String, source: crate::storage::BeneathError },
    #[error("dataset {name}: {source}")]
    Objects { name: String, source: Box<crate::objects::ObjectError> },
    #[error("dataset {name} is configured twice")]
    Duplicate { name: String },
    #[error("dataset {name}: more than {max} samples are not supported", max = u32::MAX)]
    TooLarge { name: String },
}

impl CatalogError {
    /// Why the storage of dataset `name` cannot be opened.
    fn opening(name: &str, e: OpenError) -> Self {
        match e {
            OpenError::Changed { path } => CatalogError::Changed { name: name.to_owned(), path },
            OpenError::Cannot { path, source } => CatalogError::Map { name: name.to_owned(), path, source },
            OpenError::Beneath(source) => CatalogError::Beneath { name: name.to_owned(), source },
        }
    }

    /// Whether dataset `name`'s samples can be numbered (`u32`), before its storage is opened.
    fn fits(name: &str, index: &Index) -> Result<(), Self> {
        match index.samples.len() > u32::MAX as usize {
            true => Err(CatalogError::TooLarge { name: name.to_owned() }),
            false => Ok(()),
        }
    }
}

/// Whether `e` says that bytes read keep differing from the index's checksums.
fn is_checksum(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::InvalidData
}

/// One file of a dataset's directory as served under `files/`. A stored file's path, size and
/// checksums are the index's (not copied: a tree of a million files would hold them twice).
pub enum ServedFile {
    /// Storage file `n`: a shard, or a side file after the shards.
    Stored(u32),
    /// Made from the index (a TFRecord shard's DALI index twin).
    Made(Arc<MadeFile>),
}

/// A file made from the index, and its details.
pub struct MadeFile {
    pub info: ShardInfo,
    pub bytes: Vec<u8>,
}

/// Path, size and checksums of `file` of `index`.
fn info_of<'a>(index: &'a Index, file: &'a ServedFile) -> &'a ShardInfo {
    match file {
        ServedFile::Stored(n) => {
            let n = *n as usize;
            index.shards.get(n).unwrap_or_else(|| &index.side[n - index.shards.len()])
        }
        ServedFile::Made(made) => &made.info,
    }
}

/// One served dataset.
pub struct Dataset {
    pub name: String,
    pub root: PathBuf,
    pub index: Arc<Index>,
    /// The shards, mapped or read by positioned reads, then the side files.
    pub storage: Arc<Storage>,
    /// Every file served under `files/`, sorted by path.
    pub files: Vec<ServedFile>,
    /// The record size of `tfrecord.slots` batches ([`encode::FrameSizes::slot`]).
    pub slot: u64,
    /// The mean TFRecord frame size.
    mean_frame: u64,
    /// The index's content id, as the API says it ([`batchfs::index::Index::content_id`]).
    index_id: String,
    pub origin: IndexOrigin,
    plans: Mutex<LruCache<(u64, batchfs::plan::PlanOptions), Arc<EpochPlan>>>,
    /// The plans whose batches were read last, which the disk tier follows ([`Dataset::follow`]).
    followed: Mutex<std::collections::VecDeque<(u64, batchfs::plan::PlanOptions)>>,
    /// Each manifest as it is served (compact JSON): requests for it share one buffer.
    manifests: Memo<(u64, BatchQuery), bytes::Bytes>,
    /// Manifests computed (not found in the cache).
    computations: AtomicU64,
    /// The `block_bytes` last warned of ([`Dataset::blocks_note`]).
    warned_block_bytes: AtomicU64,
    /// Each sample's TFRecord frame in bytes, once a slot table needs them.
    frames: OnceLock<Vec<u64>>,
    /// Each slot table as it is served (compact JSON, one number per record of an epoch), shared.
    slot_tables: Memo<RollingQuery, bytes::Bytes>,
    /// The sample table's encoding, once asked for.
    sample_table: OnceLock<bytes::Bytes>,
    /// Each sample's object (the shard of its first part) and each shard's bytes, once a `shuffle=blocks`
    /// plan needs them.
    objects: OnceLock<(Vec<u32>, Vec<u64>)>,
    /// For each shard that is one sample whole (a file of a file tree), that sample's id; [`NO_SAMPLE`]
    /// for the others (4 bytes a shard, where an `Option` takes 8).
    shard_samples: Vec<u32>,
}

/// A shard that is not one sample whole, in [`Dataset::shard_samples`]: no sample has this id, as a
/// dataset has at most `u32::MAX` samples ([`CatalogError::fits`]).
const NO_SAMPLE: u32 = u32::MAX;

/// How many plans and manifests each dataset keeps.
const PLAN_CACHE: usize = 16;
/// How many slot tables each dataset keeps (a mount asks for one, for the span of epochs its job reads).
const SLOT_TABLE_CACHE: usize = 4;

impl Dataset {
    /// Indexes (or loads the index of) dataset `name` at `root` and opens its shards: mapped when there
    /// are few and fit in memory, else read by positioned reads, as `io` says (see `storage.rs`).
    pub fn open(
        name: &str,
        root: &Path,
        index_dir: Option<&Path>,
        options: &IndexOptions,
        progress: &dyn Progress,
        io: IoPolicy,
    ) -> Result<Dataset, CatalogError> {
        let (index, origin) = source::load_or_build(root, name, index_dir, options, progress)
            .map_err(|source| CatalogError::Index { name: name.to_owned(), source })?;
        CatalogError::fits(name, &index)?;
        let index = Arc::new(index);
        let storage = Storage::open(name, root, options.follow_links, index.clone(), io)
            .map_err(|e| CatalogError::opening(name, e))?;
        let storage = Arc::new(storage);
        Ok(Dataset::of(name, root, index, origin, storage))
    }

    /// Lists (or loads the index of, when the listing is unchanged) the object dataset `name` at
    /// `at.url` (`s3://BUCKET/PREFIX`, `at.settings` over the `AWS_*` environment) and indexes it from
    /// ranged reads (see `objects.rs`). The index is kept in `index_dir` (`NAME.batchfs-index`), objects
    /// are staged there while indexed (else in the system's temporary directory, and the index is not
    /// kept).
    /// Whole shards that fit in `io.resident` are held in the server's memory (see `storage.rs`).
    pub fn open_objects(
        name: &str,
        at: ObjectsAt,
        index_dir: Option<&Path>,
        options: &IndexOptions,
        progress: &dyn Progress,
        io: IoPolicy,
    ) -> Result<Dataset, CatalogError> {
        let stage_dir = index_dir.map_or_else(std::env::temp_dir, Path::to_owned);
        let opened = ObjectSource::open(at, stage_dir)
            .map_err(|source| CatalogError::Objects { name: name.to_owned(), source: Box::new(source) })?;
        Self::of_objects(name, opened, index_dir, options, progress, io)
    }

    /// [`Dataset::open_objects`] of a source already listed (one of an in-memory store, in tests).
    pub fn of_objects(
        name: &str,
        (objects, listed): (ObjectSource, Vec<ShardInfo>),
        index_dir: Option<&Path>,
        options: &IndexOptions,
        progress: &dyn Progress,
        io: IoPolicy,
    ) -> Result<Dataset, CatalogError> {
        let url = PathBuf::from(objects.url());
        let index_err = |source| CatalogError::Index { name: name.to_owned(), source };
        let paths = listed.iter().map(|f| f.path.as_str());
        let format = options.format.unwrap_or_else(|| source::detect_listed(paths.clone()));
        let given = options.format.is_some();
        if let Some(shard) = source::unnamed_tfrecord_shard(paths).filter(|_| !given) {
            tracing::warn!(
                dataset = name,
                shard,
                "objects named as TensorFlow names TFRecord shards, without an extension: indexed as a file tree of \
                 whole objects; if they are TFRecord files, give the format (--format tfrecord, or format = \
                 \"tfrecord\" in [[dataset]])"
            );
        }
        let (shards, side) = source::classify(objects.root(), format, given, listed).map_err(index_err)?;
        let settings = options.settings(format);
        let path = index_dir.map(|dir| dir.join(format!("{name}.batchfs-index")));
        // Persisted only once the storage opened with it: an index its objects, read again, disagree with
        // (held in memory, each chunk checked) is never kept for the next start to load.
        let (index, origin) =
            source::load_or_build_unkept(&objects, name, path.as_deref(), settings, shards, side, progress)
                .map_err(index_err)?;
        CatalogError::fits(name, &index)?;
        let index = Arc::new(index);
        let objects = Arc::new(objects);
        let kept_at = [path.as_ref().map(|p| p.display().to_string()), objects.index_in_bucket_at()];
        let storage = Storage::of_objects(name, objects.clone(), index.clone(), io).map_err(|e| match e {
            OpenError::Cannot { path, source } if origin == IndexOrigin::Loaded && is_checksum(&source) => {
                let kept = kept_at.iter().flatten().cloned().collect::<Vec<_>>().join(" and ");
                CatalogError::IndexDisagrees { name: name.to_owned(), path, kept, source }
            }
            e => CatalogError::opening(name, e),
        })?;
        let storage = Arc::new(storage);
        if origin == IndexOrigin::Built {
            source::persist(objects.as_ref(), name, path.as_deref(), &index);
        }
        let dataset = Dataset::of(name, &url, index, origin, storage);
        if let Some(note) = dataset.tier_note() {
            tracing::warn!(dataset = name, "{note}");
        }
        Ok(dataset)
    }

    fn of(name: &str, root: &Path, index: Arc<Index>, origin: IndexOrigin, storage: Arc<Storage>) -> Dataset {
        let files = served_files(&index);
        let mut shard_samples = vec![NO_SAMPLE; index.shards.len()];
        for (id, sample) in index.samples.iter().enumerate() {
            if let [part] = sample.parts.as_slice() {
                let whole =
                    index.shards.get(part.shard as usize).is_some_and(|s| part.offset == 0 && part.len == s.size);
                if whole {
                    shard_samples[part.shard as usize] = id as u32;
                }
            }
        }
        let encode::FrameSizes { slot, mean: mean_frame } = encode::frame_sizes(&index);
        let index_id = format!("{:016x}", index.content_id());
        let cache = NonZeroUsize::new(PLAN_CACHE).expect("nonzero");
        Dataset {
            name: name.to_owned(),
            root: root.to_owned(),
            index,
            storage,
            files,
            slot,
            mean_frame,
            index_id,
            origin,
            plans: Mutex::new(LruCache::new(cache)),
            followed: Mutex::default(),
            manifests: Memo::new(PLAN_CACHE),
            computations: AtomicU64::new(0),
            warned_block_bytes: AtomicU64::new(0),
            frames: OnceLock::new(),
            slot_tables: Memo::new(SLOT_TABLE_CACHE),
            sample_table: OnceLock::new(),
            objects: OnceLock::new(),
            shard_samples,
        }
    }

    /// The API description.
    pub fn info(&self) -> DatasetInfo {
        DatasetInfo {
            name: self.name.clone(),
            format: self.index.format(),
            samples: self.index.samples.len() as u64,
            bytes: self.index.total_bytes(),
            shards: self.index.shards.len() as u64,
            classes: self.index.classes.clone(),
            skipped: self.index.skipped.len() as u64,
            slot_bytes: self.slot,
            mean_frame_bytes: self.mean_frame,
            io: self.storage.io().to_owned(),
            resident_bytes: self.storage.resident(),
            index_id: self.index_id.clone(),
        }
    }

    /// The plan of `epoch` (cached). `shuffle=blocks` without `block_bytes` takes the server's default
    /// ([`Dataset::default_block_bytes`]).
    pub fn plan(&self, epoch: u64, query: &BatchQuery) -> Result<Arc<EpochPlan>, PlanError> {
        let mut options = query.plan;
        if options.shuffle == Shuffle::Blocks && options.block_bytes == 0 {
            options.block_bytes = self.default_block_bytes();
        }
        let key = (epoch, options);
        if let Some(plan) = self.plans.lock().expect("plan cache").get(&key) {
            return Ok(plan.clone());
        }
        let plan = Arc::new(match options.shuffle {
            Shuffle::Blocks => {
                if let Some(note) = self.blocks_note(options.block_bytes) {
                    // Once per value: the plan of each epoch is made anew.
                    if self.warned_block_bytes.swap(options.block_bytes, Ordering::Relaxed) != options.block_bytes {
                        tracing::warn!("{note}");
                    }
                }
                let (of_sample, bytes) = self.objects();
                EpochPlan::of_objects(&Objects { of_sample, bytes }, epoch, options)?
            }
            _ => EpochPlan::new(self.index.samples.len() as u32, epoch, options)?,
        });
        self.plans.lock().expect("plan cache").put(key, plan.clone());
        Ok(plan)
    }

    /// Each sample's object (the shard of its first part) and each shard's bytes, for `shuffle=blocks`.
    fn objects(&self) -> (&[u32], &[u64]) {
        let (of_sample, bytes) = self.objects.get_or_init(|| {
            let of_sample = self.index.samples.iter().map(|s| s.parts.first().map_or(0, |p| p.shard)).collect();
            (of_sample, self.index.shards.iter().map(|s| s.size).collect())
        });
        (of_sample, bytes)
    }

    /// What a `shuffle=blocks` plan of `block_bytes` asked of an object dataset larger than its disk tier
    /// costs where the blocks do not fit (more than a third of the tier: two read while the next is copied
    /// in): copies evicted before they are read, each object read from the store many times an epoch (35
    /// times with `block_bytes` 25 times the tier). The plan is the mount's to choose (every server of a job
    /// must plan the same), so it is served, and the server says so.
    pub fn blocks_note(&self, block_bytes: u64) -> Option<String> {
        let tier = self.storage.objects()?.tier()?;
        let (cap, bytes) = (tier.cap(), self.on_disk(tier));
        (bytes > cap && block_bytes > cap / 3).then(|| {
            format!(
                "dataset {}: shuffle=blocks with block_bytes={block_bytes}, more than a third of the disk tier ({cap} \
                 bytes): blocks are evicted before they are read, and objects read from the store many times an \
                 epoch; mount with block_bytes at most {} (or leave it out: the server's default is {})",
                self.name,
                cap / 3,
                self.default_block_bytes()
            )
        })
    }

    /// `block_bytes` of a `shuffle=blocks` plan that does not say: a quarter of the disk tier, for an
    /// object dataset of a server with one (mounts read ahead across a block's end, so two blocks are read
    /// at once while the next is copied in, and the last quarter keeps copies the next epoch reads again:
    /// a third, the most that fits, left none, and every epoch read the store whole); else a quarter of
    /// the memory the server may use (the page cache holds a block of a local dataset).
    pub fn default_block_bytes(&self) -> u64 {
        match self.storage.objects().and_then(|o| o.tier()) {
            Some(tier) => (tier.cap() / 4).max(1),
            None => (crate::policy::memory_limit() / 4).max(1),
        }
    }

    /// What the disk tier does for this object dataset, where it cannot hold it whole, or that it has none
    /// where memory does not hold the dataset either: a line for the log and `/healthz`.
    pub fn tier_note(&self) -> Option<String> {
        let objects = self.storage.objects()?;
        let bytes: u64 = self.index.shards.iter().map(|s| s.size).sum();
        let Some(tier) = objects.tier() else {
            let held = self.storage.resident();
            return (bytes > held).then(|| {
                format!(
                    "dataset {}: {bytes} bytes in the store, {held} of them held in memory, and no disk tier: every \
                     epoch reads the rest from the store again, by ranged GETs as bodies need them; give the server \
                     a disk tier on local disks (--disk-cache DIR, or disk_cache in [limits]) to read it from the \
                     store once",
                    self.name
                )
            });
        };
        // Counted as the tier counts its copies: each rounded up to the disk's block.
        let bytes = self.on_disk(tier);
        // A block holds whole objects, a third of the tier at most: objects larger than that are never copied.
        let largest = self.index.shards.iter().map(|s| tier.on_disk(s.size)).max().unwrap_or(0);
        if bytes > tier.cap() && largest > tier.cap() / 3 {
            return Some(format!(
                "dataset {}: {bytes} bytes do not fit in the disk tier ({} bytes), and its largest object ({largest} \
                 bytes) is larger than a third of it, what a block of shuffle=blocks may hold: such objects are read \
                 by GETs every epoch whatever the shuffle; give the tier at least {} bytes (--disk-cache-size)",
                self.name,
                tier.cap(),
                largest.saturating_mul(3)
            ));
        }
        (bytes > tier.cap()).then(|| {
            format!(
                "dataset {}: {bytes} bytes do not fit in the disk tier ({} bytes): read with shuffle=global, each \
                 epoch reads the store by GETs; read it with shuffle=blocks (block_bytes at most {}) to read each \
                 object once per epoch from the tier",
                self.name,
                tier.cap(),
                tier.cap() / 3
            )
        })
    }

    /// Bytes of disk copies of every shard occupy in `tier` (as it counts them: [`Tier::on_disk`]).
    fn on_disk(&self, tier: &Tier) -> u64 {
        self.index.shards.iter().map(|s| tier.on_disk(s.size)).sum()
    }

    /// The layout of one batch, its memory asked of `charge` ([`encode::layout_within`]), and its samples.
    pub fn layout(&self, epoch: u64, batch: u64, query: &BatchQuery, charge: Charge) -> Result<Layout, PlanError> {
        let plan = self.plan(epoch, query)?;
        // A DALI index is read for every batch file as a loader opens an epoch, often the next epoch's
        // while this one is read: only bodies say where the readers are.
        if !query.format.is_index() {
            self.follow(epoch, &plan);
        }
        let samples = plan.batch(batch)?;
        Ok((encode::layout_within(&self.index, samples, query.format, self.slot, charge), samples.len() as u32))
    }

    /// The manifest of `epoch` as served, compact JSON (cached; computed and serialized once however many
    /// ask for it at the same time, and every response of it sends the same buffer). Pretty, a cached one
    /// took some 4 times the memory of the manifest it was made of.
    pub fn manifest(&self, epoch: u64, query: &BatchQuery) -> Result<bytes::Bytes, PlanError> {
        let json = self.manifests.get_or_compute((epoch, *query), || {
            Ok(serde_json::to_vec(&self.compute_manifest(epoch, query)?).expect("a manifest serializes").into())
        });
        json.map(|j| bytes::Bytes::clone(&j))
    }

    /// The slot table of `rolling/`'s fixed layout for `query`'s plan and span of epochs (cached;
    /// computed and serialized, compact JSON, once however many mounts ask for it at the same time, on every
    /// core; its responses share that buffer).
    pub fn slot_table(&self, query: &RollingQuery) -> Result<bytes::Bytes, RollingError> {
        let mut query = *query;
        if query.plan.shuffle == Shuffle::Blocks && query.plan.block_bytes == 0 {
            query.plan.block_bytes = self.default_block_bytes();
        }
        self.slot_tables
            .get_or_compute(query, || {
                let frames = self.frames.get_or_init(|| encode::frame_lens(&self.index));
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                let objects = (query.plan.shuffle == Shuffle::Blocks).then(|| self.objects());
                let objects = objects.as_ref().map(|(of_sample, bytes)| Objects { of_sample, bytes });
                let table = batchfs::rolling::slot_table_of(
                    frames,
                    objects.as_ref(),
                    query.plan,
                    query.first_epoch,
                    query.epochs,
                    threads,
                );
                let table = SlotTable { index_id: self.index_id.clone(), ..table? };
                Ok(serde_json::to_vec(&table).expect("a slot table serializes").into())
            })
            .map(|j| bytes::Bytes::clone(&j))
    }

    /// The index's content id, as the API says it (16 hex digits; [`batchfs::index::Index::content_id`]).
    pub fn index_id(&self) -> &str {
        &self.index_id
    }

    /// Checks that the shards `segments` read are as indexed (see `Storage::check`): a shard changed
    /// under the server refuses the body. Blocks (a `stat` at most once a second per shard).
    pub fn check(&self, segments: &[encode::Segment]) -> Result<(), crate::storage::ShardChanged> {
        let mut last = None;
        for segment in segments {
            if let encode::Segment::Data { shard, .. } = *segment {
                // A batch's segments run shard after shard: each is looked at once.
                if last != Some(shard) {
                    self.storage.check(shard)?;
                    last = Some(shard);
                }
            }
        }
        Ok(())
    }

    /// How many manifests this dataset has computed (not found in the cache).
    pub fn manifests_computed(&self) -> u64 {
        self.computations.load(Ordering::Relaxed)
    }

    /// Whether the manifest of `epoch` is cached or being computed.
    pub fn has_manifest(&self, epoch: u64, query: &BatchQuery) -> bool {
        self.manifests.has(&(epoch, *query))
    }

    /// Whether the slot table `query` names is cached or being computed.
    pub fn has_slot_table(&self, query: &RollingQuery) -> bool {
        self.slot_tables.has(query)
    }

    fn compute_manifest(&self, epoch: u64, query: &BatchQuery) -> Result<Manifest, PlanError> {
        self.computations.fetch_add(1, Ordering::Relaxed);
        let plan = self.plan(epoch, query)?;
        // Every batch's size and checksum, on every core: a million samples take seconds on one.
        let count = plan.batches();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(count.max(1) as usize) as u64;
        let per = count.div_ceil(threads.max(1));
        let parts: Vec<Result<Vec<BatchEntry>, PlanError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let plan = &plan;
                    scope.spawn(move || {
                        (t * per..((t + 1) * per).min(count))
                            .map(|i| {
                                let samples = plan.batch(i)?;
                                let (bytes, crc32c) = encode::summary(&self.index, samples, query.format, self.slot);
                                Ok(BatchEntry { index: i, samples: samples.len() as u32, bytes, crc32c })
                            })
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("manifest thread")).collect()
        });
        let mut batches = Vec::with_capacity(count as usize);
        for part in parts {
            batches.extend(part?);
        }
        Ok(Manifest {
            dataset: self.name.clone(),
            epoch,
            options: plan.options,
            format: query.format,
            samples: plan.order().len() as u64,
            bytes: batches.iter().map(|b| b.bytes).sum(),
            batches,
            index_id: self.index_id.clone(),
        })
    }

    /// One page of directory `q.dir`: its subdirectories and files in path order from `q.cursor`, and
    /// where the next page starts; `None` when no served file lies under that directory. Files are
    /// sorted by path, so a directory's files are one run of them, and a subdirectory's a run within
    /// it, skipped by a binary search: a page costs its entries, not the directory's size.
    pub fn list(&self, q: &FilesQuery) -> Option<FileList> {
        let prefix = if q.dir.is_empty() { String::new() } else { format!("{}/", q.dir) };
        let index = &self.index;
        let start = self.files.partition_point(|f| info_of(index, f).path < prefix);
        let end = start + self.files[start..].partition_point(|f| info_of(index, f).path.starts_with(&prefix));
        if start == end && !q.dir.is_empty() {
            return None;
        }
        let (mut dirs, mut files) = (Vec::new(), Vec::new());
        let mut at = (q.cursor as usize).clamp(start, end);
        while at < end && dirs.len() + files.len() < q.page() {
            let info = self.file_info(&self.files[at]);
            match info.path[prefix.len()..].split_once('/') {
                Some((sub, _)) => {
                    let sub_prefix = format!("{prefix}{sub}/");
                    at += self.files[at..end].partition_point(|f| info_of(index, f).path.starts_with(&sub_prefix));
                    dirs.push(sub.to_owned());
                }
                None => {
                    let sample = match self.files[at] {
                        ServedFile::Stored(n) => {
                            self.shard_samples.get(n as usize).copied().filter(|&id| id != NO_SAMPLE)
                        }
                        ServedFile::Made(_) => None,
                    };
                    files.push(FileEntry {
                        path: info.path.to_string(),
                        size: info.size,
                        crc32c: info.crc32c,
                        chunks: info.chunks.to_vec(),
                        sample,
                    });
                    at += 1;
                }
            }
        }
        let next = (at < end).then_some(at as u64);
        let index_id = self.index_id.clone();
        Some(FileList { chunk_bytes: batchfs::index::CHUNK_BYTES, dir: q.dir.clone(), dirs, files, next, index_id })
    }

    /// Resolves a `files/{path}` request, refusing anything that is not one of the served files (so no
    /// path can escape the dataset directory).
    pub fn file(&self, path: &str) -> Option<&ServedFile> {
        self.files.binary_search_by(|f| self.file_info(f).path.as_str().cmp(path)).ok().map(|i| &self.files[i])
    }

    /// Path, size and checksums of one of the served files.
    pub fn file_info<'a>(&'a self, file: &'a ServedFile) -> &'a ShardInfo {
        info_of(&self.index, file)
    }
}

/// The files of `index`'s directory, sorted by path: shards, side files, and the DALI index twins of
/// TFRecord shards that have none.
fn served_files(index: &Index) -> Vec<ServedFile> {
    let stored = index.shards.iter().chain(&index.side).enumerate();
    let mut files: Vec<ServedFile> = stored.map(|(n, _)| ServedFile::Stored(n as u32)).collect();
    for (path, bytes) in encode::shard_index_twins(index) {
        let mut info = ShardInfo { path: path.into(), size: bytes.len() as u64, ..Default::default() };
        info.checksum(&bytes);
        files.push(ServedFile::Made(Arc::new(MadeFile { info, bytes })));
    }
    files.sort_by(|a, b| info_of(index, a).path.cmp(&info_of(index, b).path));
    files
}

/// All served datasets, by name, and those still being indexed: a server answers while it indexes
/// (`/healthz` says which datasets are ready; requests for one not ready yet get 503 and `Retry-After`).
#[derive(Default)]
pub struct Catalog {
    datasets: RwLock<BTreeMap<String, Arc<Dataset>>>,
    /// Datasets announced but not ready: (bytes indexed, bytes to index).
    pending: Mutex<BTreeMap<String, (u64, u64)>>,
}

/// Where a dataset stands.
#[derive(Debug, Clone)]
pub enum Readiness {
    Ready(Arc<Dataset>),
    /// Being indexed: bytes done of total (0 of 0 before indexing starts).
    Indexing {
        done: u64,
        total: u64,
    },
    Unknown,
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dataset").field("name", &self.name).field("root", &self.root).finish_non_exhaustive()
    }
}

impl Catalog {
    /// Adds a ready dataset (one announced by [`Catalog::announce`] stops being pending).
    pub fn insert(&self, dataset: Dataset) -> Result<(), CatalogError> {
        let mut datasets = self.datasets.write().expect("catalog");
        if datasets.contains_key(&dataset.name) {
            return Err(CatalogError::Duplicate { name: dataset.name.clone() });
        }
        self.pending.lock().expect("pending").remove(&dataset.name);
        datasets.insert(dataset.name.clone(), Arc::new(dataset));
        Ok(())
    }

    /// Announces a dataset that is being indexed and will be inserted when ready.
    pub fn announce(&self, name: &str) -> Result<(), CatalogError> {
        // The locks in `insert`'s order (datasets, then pending), so the two cannot deadlock.
        let datasets = self.datasets.read().expect("catalog");
        let mut pending = self.pending.lock().expect("pending");
        if datasets.contains_key(name) || pending.contains_key(name) {
            return Err(CatalogError::Duplicate { name: name.to_owned() });
        }
        pending.insert(name.to_owned(), (0, 0));
        Ok(())
    }

    /// Records the indexing progress of an announced dataset.
    pub fn progress(&self, name: &str, done: u64, total: u64) {
        if let Some(p) = self.pending.lock().expect("pending").get_mut(name) {
            *p = (done, total);
        }
    }

    /// Looks a ready dataset up.
    pub fn get(&self, name: &str) -> Option<Arc<Dataset>> {
        self.datasets.read().expect("catalog").get(name).cloned()
    }

    /// Where dataset `name` stands.
    pub fn readiness(&self, name: &str) -> Readiness {
        if let Some(ds) = self.get(name) {
            return Readiness::Ready(ds);
        }
        match self.pending.lock().expect("pending").get(name) {
            Some(&(done, total)) => Readiness::Indexing { done, total },
            None => Readiness::Unknown,
        }
    }

    /// The ready datasets, by name.
    pub fn datasets(&self) -> Vec<Arc<Dataset>> {
        self.datasets.read().expect("catalog").values().cloned().collect()
    }

    /// The datasets still being indexed: name, bytes done, bytes to index.
    pub fn pending(&self) -> Vec<(String, u64, u64)> {
        self.pending.lock().expect("pending").iter().map(|(n, &(d, t))| (n.clone(), d, t)).collect()
    }

    /// Every dataset's name, ready or not.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.datasets.read().expect("catalog").keys().cloned().collect();
        names.extend(self.pending.lock().expect("pending").keys().cloned());
        names.sort();
        names
    }
}
