//! How the server reads a dataset's shards: mapped, by direct reads, or by positioned reads.
//!
//! **Mapped** (`io=mmap`): each shard is mapped once and bodies share the mappings (no copy). Right for
//! data that fits in the server's memory: the page cache holds it after the first epoch.
//!
//! **Direct reads** (`io=direct`): each body chunk is read from files opened `O_DIRECT`, on the blocking
//! pool, into reused aligned buffers (`aligned.rs`) that become the body's frames without a copy
//! (`direct.rs`, `uring.rs`). Right for data larger than the server's memory (LMDBIO's case): a sample
//! is one read of its (block-aligned) bytes, where a mapping faults it in page by page and the kernel's
//! readahead reads what a shuffled epoch will not use; and the page cache is not involved at all: no
//! copy out of it, no pages to insert, charge to the cgroup and reclaim, and nothing else on the machine
//! evicted.
//!
//! A direct dataset may have some of its shards **held in memory** (`resident`): read once at start into
//! anonymous memory the server owns and served from it like mapped shards. A shuffled epoch reads every
//! sample once, so holding a fraction of the dataset spares the device that fraction of every epoch's
//! reads; unlike the page cache, that memory is never thrashed by the rest of the data or reclaimed.
//!
//! **Positioned reads** (`io=pread`): the same reads through the page cache, for filesystems that
//! refuse `O_DIRECT` (tmpfs, some network filesystems). When the data does not fit, each range's pages
//! are dropped after it is read (`POSIX_FADV_DONTNEED`) and the next batches' ranges are announced ahead
//! (`POSIX_FADV_WILLNEED`, see `warm_ahead` in `service.rs`), so the device reads them in parallel.
//!
//! `io=auto` (the default) maps a dataset when it fits in half of the memory the server may use (the
//! smaller of the machine's memory and its memory cgroup's limit), else reads it directly, or by
//! positioned reads where the filesystem refuses `O_DIRECT`.
//!
//! **Many files.** A dataset of more shards than `max_mapped_shards` (a file tree of ImageNet's 1.28 M
//! images) is never mapped: each mapping is a kernel VMA, and the kernel allows `vm.max_map_count` of
//! them per process (65,530 by default), so one mapping per file cannot start. Its files are opened when
//! read, read with `pread`, and closed: no mapping and no file descriptor is held per file.
//!
//! Either way a read of storage never runs on a tokio worker: the body streams (`body.rs`) and warming
//! (`service.rs`) do it on the blocking pool, within the storage semaphore.
//!
//! **A shard changed under the server** (truncated, or rewritten in place by a conversion script) is
//! noticed and refused: [`Storage::check`] before a batch or file is served (the shard's size and mtime
//! against the index's, looked at once a second per shard; a file opened per read is looked at each
//! time it is opened), a read that comes up short, and a mapped page touched past the file's new end,
//! which reads zeros instead of killing the server ([`batchfs::mmap::guard_truncation`]). A changed
//! shard stays refused until the server restarts and re-indexes the dataset; every other shard is
//! served as before, and the clients' checksums keep out whatever bytes went out before it was noticed.
//! Shards held in memory are not looked at: they are served as indexed.
//!
//! **A file swapped for a link out of the dataset's directory** after indexing, whatever size and date it
//! is given, is refused the same way when it is opened: every file is opened beneath the directory, and
//! out of it only by links followed at start (`--follow-links`), to the files they led to then
//! (`storage/beneath.rs`). A shard held open or mapped is read from the file opened at start.

use crate::aligned::{self, DIRECT_ALIGN};
use crate::objects::{ObjectSource, ReadError};
pub use crate::policy::{IoMode, IoPolicy, Resident};
pub use beneath::{BeneathError, DatasetDir};
use holding::{hold, Holding};

mod beneath;
pub mod direct;
mod holding;
pub mod uring;
use batchfs::fd::advise;
use batchfs::index::Index;
use batchfs::mmap::MappedFile;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One shard, as the server reads it.
pub enum Shard {
    /// Mapped, or (a direct dataset's) held in the server's memory: sent from memory either way.
    Mapped(Arc<MappedFile>),
    /// Read with positioned reads from a file held open with `O_DIRECT`, in aligned blocks.
    Direct(Box<HeldFile>),
    /// Read with positioned reads from a file held open.
    Open(Box<HeldFile>),
    /// Read with positioned reads from its file (the index's path beneath the dataset's root), opened for
    /// each read and checked against its indexed size and modification time each time. Holds nothing:
    /// a dataset of a million files keeps no path or descriptor per file beside its index.
    Closed,
    /// An object of an object store, read through the storage's [`ObjectSource`].
    Object,
}

/// A shard's file held open.
pub struct HeldFile {
    pub file: File,
    pub path: PathBuf,
    pub size: u64,
}

/// A shard held open or mapped, as the index saw it: looked at again now and then to notice a change.
struct Watched {
    path: PathBuf,
    size: u64,
    mtime_ns: i64,
    /// Milliseconds since the storage opened when it was last looked at.
    checked_ms: AtomicU64,
    /// Held in the server's memory: served as indexed whatever happens to the file.
    held: bool,
}

/// How often a shard held open or mapped is looked at (stat) to notice a change.
const CHECK_EVERY_MS: u64 = 1000;

/// Every shard of one dataset, by shard number.
pub struct Storage {
    shards: Box<[Shard]>,
    /// Drop the pages of each range read from the page cache (the dataset does not fit in memory).
    drop_after_read: bool,
    /// Shards read with `O_DIRECT`.
    direct: usize,
    /// Bytes of shards held in the server's memory (`resident`).
    resident: u64,
    /// How the data shards are read: `mmap`, `direct` or `pread`.
    io: &'static str,
    /// The dataset's name, for what is logged.
    name: String,
    /// The shards held open or mapped, by shard number (empty for a dataset whose files are opened per
    /// read).
    watched: Box<[Watched]>,
    /// The shards that changed under the server, with why: refused from then on.
    changed: Mutex<std::collections::BTreeMap<u32, String>>,
    any_changed: AtomicBool,
    opened: Instant,
    /// The object store an object dataset's shards are read from.
    objects: Option<Arc<ObjectSource>>,
    /// The dataset's directory (none for objects), every file opened beneath it, and its index: where a
    /// file opened per read is, and what it should be.
    dir: Option<DatasetDir>,
    index: Arc<Index>,
}

/// Why a dataset's shards cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("a shard changed since it was indexed ({path}); restart to re-index")]
    Changed { path: PathBuf },
    #[error("cannot open shard {path}: {source}")]
    Cannot { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Beneath(#[from] BeneathError),
}

/// A shard that changed under the server since it was indexed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardChanged {
    pub dataset: String,
    pub shard: String,
    pub why: String,
}

impl std::fmt::Display for ShardChanged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dataset {}: shard {} changed since it was indexed ({}); the batches and files that read it are \
             refused until batchfs-server restarts and re-indexes it",
            self.dataset, self.shard, self.why
        )
    }
}

impl std::error::Error for ShardChanged {}

impl Storage {
    /// Opens the shards of `index` under `root` as `policy` says (see the module note), checking that
    /// each still has its indexed size. Every file is opened beneath `root`, out of it only by links
    /// followed at start where `follow_links` (`storage/beneath.rs`).
    pub fn open(
        name: &str,
        root: &Path,
        follow_links: bool,
        index: Arc<Index>,
        policy: IoPolicy,
    ) -> Result<Storage, OpenError> {
        let bytes: u64 = index.shards.iter().map(|s| s.size).sum();
        let fits = bytes <= policy.memory / 2;
        let many = index.shards.len() > policy.max_mapped_shards;
        let read = match policy.mode {
            _ if many => Read::Closed,
            _ if policy.maps(bytes) => Read::Mapped,
            IoMode::Pread => Read::Open,
            IoMode::Auto | IoMode::Direct | IoMode::Mmap => Read::Direct,
        };
        if many && policy.mode == IoMode::Mmap {
            tracing::warn!(
                dataset = name,
                shards = index.shards.len(),
                max_mapped_shards = policy.max_mapped_shards,
                "too many shards to map: reading them with positioned reads"
            );
        }
        let mut read = read;
        let mut dir = DatasetDir::open(root, follow_links)?;
        // The filesystem may refuse O_DIRECT (tmpfs, some network filesystems): the first shard says so.
        if let (Read::Direct, Some(first)) = (read, index.shards.first()) {
            let path = root.join(&first.path);
            match open_direct(&mut dir, 0, &first.path) {
                Err(BeneathError::Io { source: e, .. }) if e.kind() == std::io::ErrorKind::InvalidInput => {
                    tracing::warn!(dataset = name, path = %path.display(), error = %e,
                        "O_DIRECT refused: reading with positioned reads through the page cache");
                    read = Read::Open;
                }
                // Another error is the file's, for its own open below to report.
                _ => {}
            }
        }
        let mut shards = Vec::with_capacity(index.shards.len());
        let mut holding = Holding::new(name, &index, if read == Read::Direct { policy.resident } else { 0 });
        for (n, shard) in (0..).zip(&index.shards) {
            let path = root.join(&shard.path);
            let changed = || OpenError::Changed { path: path.clone() };
            let cannot = |source| OpenError::Cannot { path: path.clone(), source };
            match read {
                Read::Direct => {
                    let file = open_direct(&mut dir, n, &shard.path)?;
                    let size = file.metadata().map_err(cannot)?.len();
                    if size != shard.size {
                        return Err(changed());
                    }
                    if holding.takes(size) {
                        let held = hold(&file, &path, size).map_err(cannot)?;
                        holding.add(size);
                        shards.push(Shard::Mapped(Arc::new(held)));
                    } else {
                        shards.push(Shard::Direct(Box::new(HeldFile { file, path, size })));
                    }
                }
                Read::Closed => {
                    // A look per file: the index's size must still hold (reads past it would fail later).
                    let size = dir.open_first(n, &shard.path, libc::O_PATH)?.metadata().map_err(cannot)?.len();
                    if size != shard.size {
                        return Err(changed());
                    }
                    shards.push(Shard::Closed);
                }
                Read::Open => {
                    let file = dir.open_first(n, &shard.path, libc::O_RDONLY)?;
                    let size = file.metadata().map_err(cannot)?.len();
                    if size != shard.size {
                        return Err(changed());
                    }
                    shards.push(Shard::Open(Box::new(HeldFile { file, path, size })));
                }
                Read::Mapped => {
                    let file = dir.open_first(n, &shard.path, libc::O_RDONLY)?;
                    let mapped = match policy.sendfile {
                        true => MappedFile::open_sourced(file),
                        false => MappedFile::open_file(&file),
                    };
                    let mapped = mapped.map_err(cannot)?;
                    if mapped.len() != shard.size {
                        return Err(changed());
                    }
                    // Batches of a shuffled plan read samples in random order: kernel readahead would read
                    // the wrong pages, so the server warms exactly the ranges it will send instead.
                    mapped.advise(memmap2::Advice::Random);
                    shards.push(Shard::Mapped(Arc::new(mapped)));
                }
            }
        }
        let watched: Box<[Watched]> = if matches!(shards.first(), Some(Shard::Closed)) {
            Box::default()
        } else {
            let held = |s: &Shard| matches!(s, Shard::Mapped(m) if !m.is_file());
            (shards.iter().zip(&index.shards))
                .map(|(s, info)| Watched {
                    path: root.join(&info.path),
                    size: info.size,
                    mtime_ns: info.mtime_ns,
                    checked_ms: AtomicU64::new(0),
                    held: held(s),
                })
                .collect()
        };
        // Side files are read whole and seldom (under `raw/`): opened per read. Where links out are
        // followed, those they lead to now are the ones they may lead to (one that cannot be opened now
        // is refused at its read).
        for (n, side) in (index.shards.len() as u32..).zip(&index.side) {
            if follow_links {
                _ = dir.open_first(n, &side.path, libc::O_PATH);
            }
            shards.push(Shard::Closed);
        }
        let drop_after_read = matches!(read, Read::Open | Read::Closed) && !fits;
        let io = match read {
            Read::Mapped => "mmap",
            Read::Direct => "direct",
            Read::Open | Read::Closed => "pread",
        };
        tracing::info!(
            dataset = name,
            io,
            bytes,
            memory = policy.memory,
            drop_after_read,
            resident = holding.done,
            seconds = format!("{:.2}", holding.started.elapsed().as_secs_f64()),
            "storage opened"
        );
        let resident = holding.done;
        let direct = shards.iter().filter(|s| matches!(s, Shard::Direct(_))).count();
        Ok(Storage {
            shards: shards.into_boxed_slice(),
            drop_after_read,
            direct,
            resident,
            io,
            name: name.to_owned(),
            watched,
            changed: Mutex::new(Default::default()),
            any_changed: AtomicBool::new(false),
            opened: Instant::now(),
            objects: None,
            dir: Some(dir),
            index,
        })
    }

    /// The storage of an object dataset: every shard and side file of `index` an object of `source`.
    /// Whole shards that fit in `resident` (the server-wide budget `policy.resident`, as for a direct
    /// dataset; none for a dataset of more than `max_mapped_shards` objects) are read once now into the
    /// server's own memory, by ranged GETs several at once, checked
    /// against the index's CRC32Cs, and served from there like mapped shards; the rest are read by
    /// ranged GETs as bodies need them.
    pub fn of_objects(
        name: &str,
        source: Arc<ObjectSource>,
        index: Arc<Index>,
        policy: IoPolicy,
    ) -> Result<Storage, OpenError> {
        source.attach(index.clone());
        // Each held object is a mapping of its own: a dataset of more objects than `max_mapped_shards`
        // (a file tree) is read by GETs only, as a local one is by positioned reads.
        let objects = index.shards.len() + index.side.len();
        let bytes: u64 = index.shards.iter().map(|s| s.size).sum();
        let mapped = policy.maps(bytes) && objects <= policy.max_mapped_shards;
        // With a disk tier, `resident=auto` holds what a local copy would hold only where the tier holds
        // every shard now and they are read directly: the dataset then reads nothing from the store, and
        // the memory would go unused (a local copy in a memory cgroup of a quarter of the dataset served
        // an eighth of each epoch from memory, the tier's server read all of it from its disk). Else
        // nothing: the copies mapped are the kernel's to drop, and the memory goes to the reads of the
        // store (a server in a memory cgroup of a quarter of the dataset holding half of it as well was
        // OOM-killed by them).
        // Asked in this order, a file tree of more objects than that, which holds nothing anyway, does not
        // have every object's copy looked up by name (two MD5s each) at start.
        let many = index.shards.len() > policy.max_mapped_shards;
        let tiered =
            source.tier().is_some() && policy.resident_auto && (many || mapped || !source.tier_holds_every_shard());
        let budget = if many || tiered { 0 } else { policy.resident };
        let mut holding = Holding::new(name, &index, budget);
        let mut shards: Vec<Shard> = Vec::with_capacity(index.shards.len() + index.side.len());
        for n in 0..index.shards.len() + index.side.len() {
            let info = index.shards.get(n).unwrap_or_else(|| &index.side[n - index.shards.len()]);
            let path = source.path_of(n as u32);
            if n < index.shards.len() && holding.takes(info.size) {
                let held =
                    source.hold(n as u32, info).map_err(|source| OpenError::Cannot { path: path.clone(), source })?;
                holding.add(info.size);
                shards.push(Shard::Mapped(Arc::new(held)));
            } else {
                shards.push(Shard::Object);
            }
        }
        let held = holding.done;
        // Copies in the tier are read as local shards would be: mapped where the dataset fits in half the
        // memory the server may use (`io=auto`), else directly, past the page cache (mapped, the copies of
        // a dataset larger than memory churned the page cache at 0.25-0.64x a local copy's speed).
        source.map_copies(if mapped { policy.max_mapped_shards } else { 0 });
        source.read_copies_directly(!mapped && policy.mode != IoMode::Pread);
        source.copy_all();
        tracing::info!(
            dataset = name,
            url = source.url(),
            objects = shards.len(),
            resident = held,
            seconds = format!("{:.2}", holding.started.elapsed().as_secs_f64()),
            "storage opened: objects held in memory, the rest read by ranged GETs"
        );
        Ok(Storage {
            shards: shards.into_boxed_slice(),
            drop_after_read: false,
            direct: 0,
            resident: held,
            io: "objects",
            name: name.to_owned(),
            watched: Box::new([]),
            changed: Mutex::new(Default::default()),
            any_changed: AtomicBool::new(false),
            opened: Instant::now(),
            objects: Some(source),
            dir: None,
            index,
        })
    }

    /// File `n` of the index (a shard, or a side file after the shards).
    fn info(&self, n: u32) -> Option<&batchfs::index::ShardInfo> {
        let (index, n) = (&self.index, n as usize);
        index.shards.get(n).or_else(|| index.side.get(n.checked_sub(index.shards.len())?))
    }

    /// Where file `n` of a local dataset is.
    fn path_of(&self, n: u32) -> PathBuf {
        let root = self.dir.as_ref().map_or(Path::new(""), DatasetDir::path);
        root.join(self.info(n).map_or("", |i| i.path.as_str()))
    }

    /// File `n` of a local dataset, opened beneath its directory to be read now: one that leads out of it
    /// now (a link swapped in since indexing) is a change of the dataset, refused from then on.
    fn open_file(&self, n: u32) -> std::io::Result<File> {
        let (dir, info) = (self.dir.as_ref().expect("a local dataset"), self.info(n).expect("a file of the index"));
        dir.open_file(n, &info.path, libc::O_RDONLY).map_err(|e| match e {
            e if e.is_link_out() => std::io::Error::other(self.mark(n, e.to_string())),
            BeneathError::Io { ref source, .. } => std::io::Error::new(source.kind(), e),
            e => std::io::Error::other(e),
        })
    }

    /// The object source of an object dataset.
    pub fn objects(&self) -> Option<&Arc<ObjectSource>> {
        self.objects.as_ref()
    }

    /// Shard `n`'s mapping: a mapped (or held) shard's, or an object's copy in the disk tier, mapped.
    pub fn mapping(&self, n: u32) -> Option<Arc<MappedFile>> {
        match self.shard(n) {
            Shard::Mapped(map) => Some(map.clone()),
            Shard::Object => self.objects.as_ref()?.mapping(n),
            _ => None,
        }
    }

    /// Reads every `(shard, offset, len)` of `wanted` from the object store at once (coalesced, through
    /// the block cache, each checked against the index): their bytes in order. An object found changed
    /// is marked so. Blocks: call on the blocking pool.
    pub fn read_objects(&self, wanted: &[(u32, u64, u64)]) -> std::io::Result<Vec<bytes::Bytes>> {
        let Some(source) = &self.objects else {
            return Err(std::io::Error::other(format!("dataset {} is not in an object store", self.name)));
        };
        source.read_many(wanted).map_err(|e| match e {
            ReadError::Changed { shard, why } => std::io::Error::other(self.mark(shard, why).to_string()),
            ReadError::Io(e) => e,
        })
    }

    /// Brings every range of `ranges` toward memory ahead of its request ([`Storage::warm`] for each,
    /// hinted all first so the kernel reads them in parallel; an object dataset's read into its block
    /// cache, all at once, where the cache can hold them ([`ObjectSource::worth_reading_ahead`]) and the
    /// disk tier neither holds nor copies them ([`ObjectSource::to_read_ahead`])).
    /// Blocks: call on the blocking pool.
    pub fn warm_all(&self, ranges: &[(u32, u64, u64)]) -> std::io::Result<()> {
        let (remote, local): (Vec<_>, Vec<_>) =
            ranges.iter().partition(|r| matches!(self.shard(r.0), Shard::Object) && self.mapping(r.0).is_none());
        for &(shard, offset, len) in &local {
            self.will_need(shard, offset, len);
        }
        for &(shard, offset, len) in &local {
            self.warm(shard, offset, len)?;
        }
        let bytes = remote.iter().map(|r| r.2).sum();
        if let Some(objects) = self.objects.as_ref().filter(|o| !remote.is_empty() && o.worth_reading_ahead(bytes)) {
            // What is left may be nothing: reading nothing sends no GET.
            self.read_objects(&objects.to_read_ahead(&remote))?;
        }
        Ok(())
    }

    /// Checks that shard `n` is still as indexed, before a body that reads it is served (see the module
    /// note): a shard found changed (now, or before) is refused. Looks at the file at most once a second
    /// per shard (a `stat`): call on the blocking pool.
    pub fn check(&self, n: u32) -> Result<(), ShardChanged> {
        if self.any_changed.load(Ordering::Acquire) {
            if let Some(why) = self.changed.lock().expect("changed").get(&n) {
                return Err(self.shard_changed(n, why.clone()));
            }
        }
        if let (Shard::Object, Some(objects)) = (self.shard(n), &self.objects) {
            // A copy in the disk tier cut under the server is the tier's to drop: the store still has it.
            objects.drop_cut_copy(n);
        }
        let Some(w) = self.watched.get(n as usize).filter(|w| !w.held) else { return Ok(()) };
        if let Shard::Mapped(map) = self.shard(n) {
            if map.was_cut() {
                return Err(self.mark(n, "a page past its end was read: it was truncated".into()));
            }
        }
        let now = self.opened.elapsed().as_millis() as u64 + CHECK_EVERY_MS;
        let last = w.checked_ms.load(Ordering::Relaxed);
        if now < last + CHECK_EVERY_MS
            || w.checked_ms.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_err()
        {
            return Ok(());
        }
        match std::fs::metadata(&w.path) {
            Ok(m) => match differs(w.size, w.mtime_ns, &m) {
                Some(why) => Err(self.mark(n, why)),
                None => Ok(()),
            },
            Err(e) => Err(self.mark(n, format!("cannot stat it: {e}"))),
        }
    }

    /// The shards that changed under the server, with why.
    pub fn changed(&self) -> Vec<ShardChanged> {
        let changed = self.changed.lock().expect("changed");
        changed.iter().map(|(&n, why)| self.shard_changed(n, why.clone())).collect()
    }

    /// Records that shard `n` changed (logged once per shard) and says so.
    fn mark(&self, n: u32, why: String) -> ShardChanged {
        let mut changed = self.changed.lock().expect("changed");
        let why = changed.entry(n).or_insert_with(|| {
            let c = self.shard_changed(n, why.clone());
            tracing::error!(dataset = %c.dataset, shard = %c.shard, why = %c.why, "{c}");
            why
        });
        self.any_changed.store(true, Ordering::Release);
        self.shard_changed(n, why.clone())
    }

    /// Its path in the dataset: its file name alone was one of many in a file tree (`cat/1.jpg`, `dog/1.jpg`).
    fn shard_changed(&self, n: u32, why: String) -> ShardChanged {
        let shard = self.info(n).map_or_else(|| format!("#{n}"), |i| i.path.to_string());
        ShardChanged { dataset: self.name.clone(), shard, why }
    }

    /// Shard `n`.
    pub fn shard(&self, n: u32) -> &Shard {
        &self.shards[n as usize]
    }

    /// How many shards are mapped, or held in memory (a direct dataset's `resident` shards).
    pub fn mapped(&self) -> usize {
        self.shards.iter().filter(|s| matches!(s, Shard::Mapped(_))).count()
    }

    /// How many shards are read with `O_DIRECT` (none, or the data shards not held in memory).
    pub fn direct(&self) -> usize {
        self.direct
    }

    /// How the data shards are read: `mmap`, `direct` (some perhaps held in memory) or `pread`.
    pub fn io(&self) -> &'static str {
        self.io
    }

    /// Bytes of direct shards held in the server's memory instead (`resident`).
    pub fn resident(&self) -> u64 {
        self.resident
    }

    /// Whether the pages of each range read are dropped from the page cache afterwards.
    pub fn drops_after_read(&self) -> bool {
        self.drop_after_read
    }

    /// Brings `[offset, offset + len)` of shard `n` toward memory ahead of its request. Mapped: faults it
    /// in and waits; read by `pread`: asks the kernel to start reading it and returns. Blocks: call on
    /// the blocking pool.
    pub fn warm(&self, n: u32, offset: u64, len: u64) -> std::io::Result<()> {
        match self.shard(n) {
            Shard::Mapped(map) => {
                if !map.is_resident(offset, len) {
                    map.fault_in(offset, len);
                }
                Ok(())
            }
            Shard::Open(held) => advise(&held.file, offset, len, libc::POSIX_FADV_WILLNEED),
            Shard::Closed => advise(&self.open_file(n)?, offset, len, libc::POSIX_FADV_WILLNEED),
            // Direct reads bypass the page cache: pages brought in ahead would only be read twice.
            Shard::Direct(_) => Ok(()),
            // A copy in the tier is warmed as a mapped shard is; else read into the block cache (`warm_all`
            // reads a batch's ranges at once, where the cache holds them).
            Shard::Object => match self.mapping(n) {
                Some(map) if !map.is_resident(offset, len) => {
                    map.fault_in(offset, len);
                    Ok(())
                }
                Some(_) => Ok(()),
                None => self.read_objects(&[(n, offset, len)]).map(drop),
            },
        }
    }

    /// Whether reading `[offset, offset + len)` of shard `n` ahead would do nothing: a mapped shard whose
    /// pages are all resident (mincore), or a direct shard (read past the page cache, never ahead). Files
    /// read by `pread` are not asked, so they are always hinted.
    pub fn nothing_to_read_ahead(&self, n: u32, offset: u64, len: u64) -> bool {
        match self.shard(n) {
            Shard::Mapped(map) => map.is_resident(offset, len),
            Shard::Object => self.mapping(n).is_some_and(|map| map.is_resident(offset, len)),
            Shard::Direct(_) => true,
            Shard::Open(_) | Shard::Closed => false,
        }
    }

    /// Hints that `[offset, offset + len)` of shard `n` will be read soon (does not block).
    pub fn will_need(&self, n: u32, offset: u64, len: u64) {
        match self.shard(n) {
            Shard::Mapped(map) => map.will_need(offset, len),
            Shard::Object => {
                if let Some(map) = self.mapping(n) {
                    map.will_need(offset, len);
                }
            }
            Shard::Open(held) => {
                let _ = advise(&held.file, offset, len, libc::POSIX_FADV_WILLNEED);
            }
            // Opening a file to hint it costs what reading a small file does: `warm` does it.
            Shard::Closed | Shard::Direct(_) => {}
        }
    }

    /// Appends `[offset, offset + len)` of shard `n`, read by positioned reads (held open, or opened
    /// now), to `out`. Blocks: call on the blocking pool. (Mapped shards are sent as views of their
    /// mapping, and direct ones read into aligned buffers: `body.rs`.)
    pub fn read(&self, n: u32, offset: u64, len: u64, out: &mut Vec<u8>) -> std::io::Result<()> {
        let start = out.len();
        let (opened, at);
        let (file, path, size) = match self.shard(n) {
            Shard::Open(held) => (&held.file, &held.path, held.size),
            Shard::Closed => {
                let info = self.info(n).expect("a file of the index");
                at = self.path_of(n);
                opened = self.open_file(n)?;
                if let Some(why) = differs(info.size, info.mtime_ns, &opened.metadata()?) {
                    return Err(std::io::Error::other(self.mark(n, why).to_string()));
                }
                (&opened, &at, info.size)
            }
            Shard::Object => {
                let bytes = self.read_objects(&[(n, offset, len)])?;
                out.extend_from_slice(&bytes[0]);
                return Ok(());
            }
            Shard::Mapped(_) | Shard::Direct(_) => {
                return Err(std::io::Error::other(format!("shard #{n} is not read by positioned reads")));
            }
        };
        if offset + len > size {
            return Err(std::io::Error::other(format!("{}: range past the indexed size", path.display())));
        }
        out.resize(start + len as usize, 0);
        // A file shorter than indexed changed under the server: the body must not go on.
        file.read_exact_at(&mut out[start..], offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                self.mark(n, "it is shorter than indexed".into());
            }
            std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
        })?;
        if self.drop_after_read {
            let _ = advise(file, offset, len, libc::POSIX_FADV_DONTNEED);
        }
        Ok(())
    }

    /// The descriptor of direct shard `n` (opened `O_DIRECT`), once `[offset, offset + len)` is checked
    /// to lie within its indexed size; for an object whose copy in the disk tier is read directly, the
    /// copy, opened now and kept open by the read (`WouldBlock` where the tier no longer holds it: the
    /// bytes are then read another way).
    pub fn direct_fd(&self, n: u32, offset: u64, len: u64) -> std::io::Result<DirectFd> {
        let (fd, keep, size) = match self.shard(n) {
            Shard::Direct(held) => (held.file.as_raw_fd(), None, held.size),
            Shard::Object => match self.objects.as_ref().and_then(|objects| objects.direct_copy(n, len)) {
                Some(copy) => (copy.as_raw_fd(), Some(copy), self.info(n).map_or(0, |i| i.size)),
                None => return Err(std::io::Error::new(std::io::ErrorKind::WouldBlock, "not in the disk tier now")),
            },
            _ => unreachable!("a direct read of a shard not opened for direct reads"),
        };
        if offset + len > size {
            let message = format!("{}: range past the indexed size", self.shown_path(n).display());
            return Err(std::io::Error::other(message));
        }
        Ok(DirectFd { fd, keep })
    }

    /// Completes a direct read of shard `n` from `start` (aligned) into `window` (aligned, the read's
    /// whole room) once `got` bytes of it are there (read some other way, e.g. by io_uring): reads until
    /// the first `need` bytes are in. Blocks: call on the blocking pool.
    pub fn finish_direct(
        &self,
        n: u32,
        read: &DirectFd,
        window: &mut [u8],
        start: u64,
        need: usize,
        mut got: usize,
    ) -> std::io::Result<()> {
        let file = match (self.shard(n), &read.keep) {
            (Shard::Direct(held), _) => &held.file,
            (Shard::Object, Some(copy)) => &**copy,
            _ => unreachable!("a direct read of a shard not opened for direct reads"),
        };
        let context = |e: std::io::Error| {
            match (&read.keep, self.objects.as_ref()) {
                // A copy in the tier that fails or ends short: dropped, the object read from the store next.
                (Some(_), Some(objects)) => objects.direct_copy_failed(n, &e),
                _ if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    _ = self.mark(n, "it is shorter than indexed".into())
                }
                _ => {}
            }
            std::io::Error::new(e.kind(), format!("{}: {e}", self.shown_path(n).display()))
        };
        debug_assert!(start.is_multiple_of(DIRECT_ALIGN) && need <= window.len());
        // Short reads come only at the end of the file (the last block is partial): read until the range
        // is in, and fail if the file ends before it (it shrank under the server).
        while got < need {
            // A read after a partial block would be unaligned: only the file's end stops one short.
            if !got.is_multiple_of(DIRECT_ALIGN as usize) {
                return Err(context(std::io::ErrorKind::UnexpectedEof.into()));
            }
            match file.read_at(&mut window[got..], start + got as u64) {
                Ok(0) => return Err(context(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(k) => got += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(context(e)),
            }
        }
        Ok(())
    }

    /// Shard `n`'s path, or object `n`'s address, as messages show it.
    fn shown_path(&self, n: u32) -> PathBuf {
        self.objects.as_ref().map_or_else(|| self.path_of(n), |objects| objects.path_of(n))
    }

    /// Whether shard `n` is read with `O_DIRECT`: a direct shard, or an object whose copy the disk tier
    /// holds and reads so now.
    pub fn is_direct(&self, n: u32) -> bool {
        match self.shard(n) {
            Shard::Direct(_) => true,
            Shard::Object => self.objects.as_ref().is_some_and(|o| o.direct_copy_held(n)),
            _ => false,
        }
    }
}

/// The descriptor a direct read reads ([`Storage::direct_fd`]), and what keeps it open for the read (a
/// copy in the disk tier opened for it; a direct shard's stays open with its storage).
pub struct DirectFd {
    pub fd: RawFd,
    pub keep: Option<Arc<File>>,
}

/// Why a file of `size` bytes modified at `mtime_ns` (as indexed) is not the file `now` describes (a link's
/// target), if it is not: its date read as indexing reads it.
fn differs(size: u64, mtime_ns: i64, now: &std::fs::Metadata) -> Option<String> {
    if now.len() != size {
        Some(format!("{} bytes, {size} when indexed", now.len()))
    } else if batchfs::source::modified_ns(now) != mtime_ns {
        Some("modified since it was indexed, its size kept".into())
    } else {
        None
    }
}

/// The aligned bytes a direct read of `[offset, offset + len)` covers.
pub fn direct_span(offset: u64, len: u64) -> u64 {
    aligned::align_up(offset + len) - aligned::align_down(offset)
}

/// How a dataset's data shards are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    Mapped,
    Direct,
    Open,
    Closed,
}

/// File `n` of `dir`, at `rel`, opened for direct reads. A filesystem without `O_DIRECT` refuses at open
/// (`EINVAL`) or at the first read: one aligned block is read to find out.
fn open_direct(dir: &mut DatasetDir, n: u32, rel: &str) -> Result<File, BeneathError> {
    let file = dir.open_first(n, rel, libc::O_RDONLY | libc::O_DIRECT)?;
    let pool = aligned::Pool::new(DIRECT_ALIGN as usize, 0);
    let mut probe = pool.take();
    file.read_at(probe.window(), 0).map_err(|source| BeneathError::Io { path: dir.path().join(rel), source })?;
    Ok(file)
}

/// Datasets for the server's unit tests.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;
    use batchfs::gen::{self, GenOptions};
    use batchfs::source::{self, IndexOptions, NoProgress};

    /// `samples` generated TFRecord samples of about `mean_bytes` in `shards` shards, indexed.
    pub fn dataset(samples: u32, mean_bytes: u64, shards: u32) -> (tempfile::TempDir, Index) {
        let dir = tempfile::tempdir().unwrap();
        let options = GenOptions { samples, mean_bytes, shards, ..Default::default() };
        gen::generate(&options, dir.path()).unwrap();
        let (index, _) = source::load_or_build(dir.path(), "t", None, &IndexOptions::default(), &NoProgress).unwrap();
        (dir, index)
    }

    /// The storage of `index` under `root`, read as `mode` says (never too many shards to map, memory
    /// enough for all).
    pub fn open(root: &Path, index: &Index, mode: IoMode) -> Storage {
        Storage::open(
            "t",
            root,
            false,
            Arc::new(index.clone()),
            IoPolicy {
                mode,
                max_mapped_shards: usize::MAX,
                memory: u64::MAX,
                resident: 0,
                resident_auto: false,
                sendfile: false,
            },
        )
        .unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[offset, offset + len)` of shard `n` of `storage` appended to `out`, however it is read: from the
    /// mapping, by a direct read into an aligned buffer, or by positioned reads.
    fn read_any(storage: &Storage, n: u32, offset: u64, len: u64, out: &mut Vec<u8>) -> std::io::Result<()> {
        match storage.shard(n) {
            Shard::Mapped(map) => out.extend_from_slice(&map.bytes()[offset as usize..(offset + len) as usize]),
            Shard::Direct(_) => {
                let read = storage.direct_fd(n, offset, len)?;
                let (first, span) = (aligned::align_down(offset), direct_span(offset, len) as usize);
                let mut buf = aligned::Pool::new(span, 0).take();
                let need = (offset + len - first) as usize;
                storage.finish_direct(n, &read, &mut buf.window()[..span], first, need, 0)?;
                let at = (offset - first) as usize;
                out.extend_from_slice(&buf.window()[at..at + len as usize]);
            }
            Shard::Open(_) | Shard::Closed | Shard::Object => storage.read(n, offset, len, out)?,
        }
        Ok(())
    }
    use batchfs::gen::{self, GenOptions};
    use batchfs::index::SourceFormat;
    use batchfs::source::{self, IndexOptions, NoProgress};

    /// A changed file of a file tree is named by its path in the dataset: its file name alone was one of many
    /// (`class-0/00000003.bin` and `class-1/00000003.bin`).
    #[test]
    fn a_changed_shard_is_named_by_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let options = GenOptions { format: SourceFormat::Files, samples: 12, mean_bytes: 3000, ..Default::default() };
        gen::generate(&options, dir.path()).unwrap();
        let (index, _) = source::load_or_build(dir.path(), "t", None, &IndexOptions::default(), &NoProgress).unwrap();
        // Mapped files: each looked at (a `stat`) as it is read, at most once a second.
        let policy = IoPolicy {
            mode: IoMode::Mmap,
            max_mapped_shards: usize::MAX,
            memory: u64::MAX,
            resident: 0,
            resident_auto: false,
            sendfile: false,
        };
        let storage = Storage::open("t", dir.path(), false, Arc::new(index.clone()), policy).unwrap();
        let path = index.shards[5].path.to_string();
        assert!(path.contains('/'), "{path}");
        std::fs::write(dir.path().join(&path), b"other bytes").unwrap();
        let changed = storage.check(5).unwrap_err();
        assert_eq!(changed.shard, path);
        assert!(changed.to_string().contains(&format!("shard {path} changed")), "{changed}");
    }

    /// A shard that is a link is served as indexed, and a link made again to the same file (a job's setup
    /// run twice: `ln -sf`) is no change; its target rewritten is one.
    #[test]
    fn a_link_made_again_to_the_same_file_is_no_change_and_its_target_rewritten_is() {
        let elsewhere = tempfile::tempdir().unwrap();
        let options = GenOptions { samples: 20, mean_bytes: 3000, shards: 1, ..Default::default() };
        gen::generate(&options, elsewhere.path()).unwrap();
        let shard = std::fs::read_dir(elsewhere.path()).unwrap().next().unwrap().unwrap().path();
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("a.tfrecord");
        std::os::unix::fs::symlink(&shard, &link).unwrap();
        let options = IndexOptions { follow_links: true, ..IndexOptions::default() };
        let (index, _) = source::load_or_build(dir.path(), "t", None, &options, &NoProgress).unwrap();
        // Mapped (looked at by `check`), and opened per read (looked at by `read`), links out followed.
        let policy = |mode, max_mapped_shards| IoPolicy {
            mode,
            max_mapped_shards,
            memory: u64::MAX,
            resident: 0,
            resident_auto: false,
            sendfile: false,
        };
        let open = |mode, max| Storage::open("t", dir.path(), true, Arc::new(index.clone()), policy(mode, max));
        let mapped = open(IoMode::Mmap, usize::MAX).unwrap();
        let per_read = open(IoMode::Auto, 0).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::remove_file(&link).unwrap();
        std::os::unix::fs::symlink(&shard, &link).unwrap();
        mapped.check(0).unwrap();
        per_read.read(0, 0, 10, &mut Vec::new()).unwrap();
        let (_, origin) = source::load_or_build(dir.path(), "t", None, &options, &NoProgress).unwrap();
        assert_eq!(origin, source::IndexOrigin::Loaded, "a link made again re-read its file");
        // The target rewritten (its size kept, its date not): a change, wherever it is looked at.
        let bytes = std::fs::read(&shard).unwrap();
        std::fs::write(&shard, &bytes).unwrap();
        let fresh = open(IoMode::Mmap, usize::MAX).unwrap();
        assert!(fresh.check(0).is_err());
        assert!(per_read.read(0, 0, 10, &mut Vec::new()).is_err());
    }

    /// A file of a tree (opened per read) swapped for a link to a file out of the dataset, given its size
    /// and date (what the size-and-date guard compares), is refused, not read: a change of the dataset.
    #[test]
    fn a_file_swapped_for_a_link_out_of_the_dataset_is_refused_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let options = GenOptions { format: SourceFormat::Files, samples: 12, mean_bytes: 3000, ..Default::default() };
        gen::generate(&options, dir.path()).unwrap();
        let (index, _) = source::load_or_build(dir.path(), "t", None, &IndexOptions::default(), &NoProgress).unwrap();
        let policy = IoPolicy {
            mode: IoMode::Auto,
            max_mapped_shards: 0,
            memory: u64::MAX,
            resident: 0,
            resident_auto: false,
            sendfile: false,
        };
        let storage = Storage::open("t", dir.path(), false, Arc::new(index.clone()), policy).unwrap();
        let (n, info) = (3, &index.shards[3]);
        let shard = dir.path().join(info.path.as_str());
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("secret");
        std::fs::write(&secret, vec![0x5e; info.size as usize]).unwrap();
        let date = std::fs::metadata(&shard).unwrap().modified().unwrap();
        std::fs::File::options().write(true).open(&secret).unwrap().set_modified(date).unwrap();
        std::fs::remove_file(&shard).unwrap();
        std::os::unix::fs::symlink(&secret, &shard).unwrap();
        assert!(differs(info.size, info.mtime_ns, &std::fs::metadata(&shard).unwrap()).is_none());
        let mut out = Vec::new();
        let refused = storage.read(n, 0, info.size, &mut out).unwrap_err();
        assert!(out.is_empty() && refused.to_string().contains("leads out of the dataset's directory"), "{refused}");
        assert!(storage.warm(n, 0, info.size).is_err());
        let changed = storage.check(n).unwrap_err();
        assert_eq!((changed.dataset.as_str(), changed.shard.as_str()), ("t", info.path.as_str()));
        assert_eq!(storage.changed().len(), 1);
        // The other files are read as before.
        storage.read(2, 0, index.shards[2].size, &mut out).unwrap();
    }

    #[test]
    fn mapped_and_file_shards_read_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let options = GenOptions { format: SourceFormat::Files, samples: 12, mean_bytes: 3000, ..Default::default() };
        gen::generate(&options, dir.path()).unwrap();
        let (index, _) = source::load_or_build(dir.path(), "t", None, &IndexOptions::default(), &NoProgress).unwrap();
        let policy = |mode, max_mapped_shards, memory| IoPolicy {
            mode,
            max_mapped_shards,
            memory,
            resident: 0,
            resident_auto: false,
            sendfile: false,
        };
        let shared = Arc::new(index.clone());
        let open = |p: IoPolicy| Storage::open("t", dir.path(), false, shared.clone(), p);
        let mapped = open(policy(IoMode::Mmap, usize::MAX, u64::MAX)).unwrap();
        let held = open(policy(IoMode::Pread, usize::MAX, u64::MAX)).unwrap();
        let direct = open(policy(IoMode::Direct, usize::MAX, u64::MAX)).unwrap();
        // Too large for a server of 1 KiB: auto reads it directly.
        let auto_direct = open(policy(IoMode::Auto, usize::MAX, 1024)).unwrap();
        let files = open(policy(IoMode::Auto, 1, u64::MAX)).unwrap();
        // Too large for a server of 1 KiB, read by pread: dropped from the page cache after reading.
        let big = open(policy(IoMode::Pread, usize::MAX, 1024)).unwrap();
        let fits = open(policy(IoMode::Auto, usize::MAX, u64::MAX)).unwrap();
        // Direct, with room in memory for the first two shards and a byte: those two are held there, and
        // the third, which does not fit whole in what is left, is read directly like the rest.
        let room = index.shards[0].size + index.shards[1].size;
        let partly = open(IoPolicy { resident: room + 1, ..policy(IoMode::Direct, usize::MAX, u64::MAX) }).unwrap();
        assert!(index.shards[2].size > 1);
        assert_eq!((partly.mapped(), partly.direct(), partly.resident()), (2, index.shards.len() - 2, room));
        assert!(matches!(partly.shard(1), Shard::Mapped(_)) && partly.is_direct(2));
        assert_eq!(mapped.mapped(), index.shards.len());
        assert_eq!(fits.mapped(), index.shards.len());
        assert_eq!((held.mapped(), files.mapped(), big.mapped()), (0, 0, 0));
        assert!(big.drops_after_read() && !held.drops_after_read() && !files.drops_after_read());
        assert!(matches!(files.shard(0), Shard::Closed) && matches!(held.shard(0), Shard::Open(_)));
        assert_eq!((direct.direct(), auto_direct.direct()), (index.shards.len(), index.shards.len()));
        assert!(!direct.drops_after_read() && !auto_direct.drops_after_read());
        for (n, shard) in index.shards.iter().enumerate() {
            let mut want = Vec::new();
            read_any(&mapped, n as u32, 1, shard.size - 1, &mut want).unwrap();
            for other in [&held, &files, &big, &direct, &partly] {
                let mut got = vec![7u8];
                read_any(other, n as u32, 1, shard.size - 1, &mut got).unwrap();
                assert_eq!(&got[1..], &want[..], "shard {n}");
                other.warm(n as u32, 0, shard.size).unwrap();
                other.will_need(n as u32, 0, shard.size);
            }
            // Read ahead only what may not be in memory: a mapped shard just read is; files read by
            // pread are always asked; direct reads are never read ahead.
            assert!(mapped.nothing_to_read_ahead(n as u32, 0, shard.size), "shard {n}");
            assert!(
                !held.nothing_to_read_ahead(n as u32, 0, shard.size)
                    && !files.nothing_to_read_ahead(n as u32, 0, shard.size)
            );
            assert!(direct.nothing_to_read_ahead(n as u32, 0, shard.size));
        }
        for other in [&held, &files, &direct] {
            let past = read_any(other, 0, index.shards[0].size, 1, &mut Vec::new()).unwrap_err();
            assert!(past.to_string().contains("past the indexed size"), "{past}");
        }
        // A file that shrinks under a direct reader: the read fails, no short range is returned.
        let first = dir.path().join(&index.shards[0].path);
        let size = index.shards[0].size;
        std::fs::OpenOptions::new().write(true).open(&first).unwrap().set_len(size - 1).unwrap();
        let short = read_any(&direct, 0, size / 2, size - size / 2, &mut Vec::new()).unwrap_err();
        assert_eq!(short.kind(), std::io::ErrorKind::UnexpectedEof, "{short}");
        // A file that changed size since indexing is refused at open, whatever the mode.
        std::fs::write(&first, b"shorter").unwrap();
        let modes = [IoMode::Mmap, IoMode::Pread, IoMode::Direct];
        for p in [policy(IoMode::Auto, 1, u64::MAX)].into_iter().chain(modes.map(|m| policy(m, 99, 0))) {
            assert!(matches!(open(p), Err(OpenError::Changed { .. })));
        }
    }

    #[test]
    fn io_modes_parse_and_memory_is_detected() {
        assert_eq!(IoMode::parse("pread"), Ok(IoMode::Pread));
        assert_eq!(IoMode::parse(" mmap"), Ok(IoMode::Mmap));
        assert_eq!(IoMode::parse("direct"), Ok(IoMode::Direct));
        assert!(IoMode::parse("odirect").unwrap_err().to_string().contains("auto, mmap, pread or direct"));
        assert_eq!(Resident::parse("auto"), Ok(Resident::Auto));
        assert_eq!(Resident::parse("512M"), Ok(Resident::Bytes(512 << 20)));
        assert!(Resident::parse("lots").is_err());
        let memory = crate::policy::memory_limit();
        assert!(memory > 64 << 20 && memory < u64::MAX, "{memory}");
    }
}
