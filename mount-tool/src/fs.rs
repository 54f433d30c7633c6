//! The filesystem, without FUSE: names, inodes, attributes, directory listings and reads, driven by the
//! FUSE adapter (`fuse.rs`) and directly by tests.
//!
//! ```text
//! /                       epoch-0000 ... epoch-{epochs-1}, .batchfs
//! /epoch-NNNN/            batch-000000.tfrecord (+ batch-000000.tfrecord.idx) | batch-000000.tar
//! /.batchfs/stats         live JSON counters
//! /raw/...                the dataset directory's files as they are on the server (every source)
//! /rolling/               one epoch's names; each open of one serves the next epoch of that file
//! /shuffled/CLASS/...     a file tree's samples by class, each name a new sample of that class in plan
//!                         order, as ImageFolder's shuffled reads ask for them
//! ```
//! Any epoch number up to 999,999 resolves by name, listed or not. `stat` and `readdir` use manifests
//! (and `rolling/`'s slot table) only, never sample data. The rooms: `fs/inode.rs` (inode numbers that
//! encode what they name, and the names), `fs/error.rs` (errors and their errnos), `fs/rolling.rs`
//! (`rolling/`'s counters and layouts), `fs/raw.rs` (`raw/`'s tree), `fs/shuffled.rs` (`shuffled/`'s
//! names and which thread gets which sample) and `fs/handles.rs` (open handles).

use crate::prefetch::{Listing, ObjectKey, Prefetcher, ReadError, WINDOW_GROUPS};
use batchfs::encode::BatchFormat;
use batchfs::plan::MAX_EPOCH;
use bytes::Bytes;
use std::sync::Arc;
use std::time::SystemTime;

mod error;
pub mod handles;
mod inode;
pub mod open_files;
mod raw;
mod rolling;
mod shuffled;
pub use crate::options::RollingMode;
pub use error::FsError;
pub use inode::*;
use inode::{parse_epoch, MAX_BATCHES};
use raw::RawTree;
use rolling::{Layout, RollingState};
use shuffled::ShuffledView;

/// The name of the statistics directory.
pub const META_NAME: &str = ".batchfs";
/// The name of the source-file tree.
pub const RAW_NAME: &str = "raw";
/// Entries of a `raw/` directory, an epoch directory or `rolling/` one `readdir` call returns at most.
pub const READDIR_BATCH: usize = 4096;

/// The name of the rolling epoch view.
pub const ROLLING_NAME: &str = "rolling";
/// The name of the class-folder view.
pub const SHUFFLED_NAME: &str = "shuffled";

/// Attributes of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub node: Node,
    pub size: u64,
}

/// Mount-wide settings of the filesystem view.
#[derive(Debug, Clone)]
pub struct FsOptions {
    /// Epoch directories listed in the root (any epoch resolves by name).
    pub epochs: u64,
    /// `tfrecord` (with `.idx` twins) or `tar`.
    pub format: BatchFormat,
    pub uid: u32,
    pub gid: u32,
    /// Times reported for every node.
    pub time: SystemTime,
    /// Show `raw/` (the dataset's source files).
    pub raw: bool,
    /// How `rolling/` lays out TFRecord batches.
    pub rolling: RollingMode,
    /// The epoch the first open of each `rolling/` file serves.
    pub first_epoch: u64,
    /// The class folders of `shuffled/` (a file tree's first directories); none: no `shuffled/`.
    pub classes: Vec<String>,
}

/// What a file reads: a batch (or a placed file of `rolling/`), a file of `raw/` (by its directory's id
/// and its position there), or the indexed layout's twin of a `rolling/` name (made here).
enum Source {
    Batch(ObjectKey),
    Raw { dir: u32, file: u64 },
    RollingIndex(u64),
    Shuffled { epoch: u64, class: u32, k: u64 },
}

/// A verified file for the kernel to serve ([`Fs::backing_file`]): a memory file, or the node cache's file
/// on a local disk (`on_disk`; a kernel may refuse a file on a stacked filesystem such as overlayfs).
pub struct Backing {
    pub file: Arc<std::fs::File>,
    pub on_disk: bool,
}

/// The filesystem.
pub struct Fs {
    prefetcher: Arc<Prefetcher>,
    pub options: FsOptions,
    raw: RawTree,
    rolling: RollingState,
    shuffled: ShuffledView,
}

impl Fs {
    pub fn new(prefetcher: Arc<Prefetcher>, options: FsOptions) -> Self {
        let rolling = RollingState::new(options.rolling, options.first_epoch, options.epochs);
        // Inode numbers hold 17 bits of class: a tree of more first directories is not a class-folder tree.
        let classes = if options.classes.len() as u64 > MAX_CLASSES {
            tracing::warn!(classes = options.classes.len(), "no shuffled/: more first directories than it numbers");
            Vec::new()
        } else {
            options.classes.clone()
        };
        let shuffled = ShuffledView::new(classes, options.first_epoch, options.epochs);
        Fs { prefetcher, options, raw: RawTree::new(), rolling, shuffled }
    }

    /// Writes the views' state through to `ledger` (for a worker that takes over this mount), having taken
    /// what it holds (a worker before this one wrote it): `rolling/`'s counters and readers, `shuffled/`'s
    /// cursors, and `raw/`'s listings, listed again in their order before `raw/` answers.
    pub fn record_in(&mut self, ledger: Arc<crate::ledger::Ledger>) {
        self.rolling.record_in(ledger.clone());
        self.shuffled.record_in(ledger.clone());
        self.raw.record_in(ledger, self.prefetcher.clone());
    }

    /// Process `owner` has handle of `ino` open, opened under a worker before this one: held again as the
    /// open held it (a `rolling/` packed file is found by name by its process until released).
    pub fn adopted(&self, ino: u64, owner: u32) {
        if let Some(Node::Rolling { epoch, batch, file: file @ (RollingFile::Packed | RollingFile::PackedIndex) }) =
            Node::from_ino(ino)
        {
            self.rolling.hold(batch, file, epoch, owner);
        }
    }

    /// Directory node `n` of `raw/`, listed from the server if it is not yet (`raw/` hidden: none).
    fn raw_listed(&self, n: u32) -> Result<(), FsError> {
        if !self.options.raw {
            return Err(FsError::NotFound);
        }
        self.raw.listed(&self.prefetcher, n)
    }

    /// The parent directory of directory `ino` (the root is its own).
    pub fn parent(&self, ino: u64) -> u64 {
        match Node::from_ino(ino) {
            Some(Node::RawDir(0) | Node::Epoch(_) | Node::MetaDir | Node::RollingDir | Node::ShuffledDir) => ROOT,
            Some(Node::ShuffledClass(_)) => SHUFFLED_DIR,
            Some(Node::RawDir(n)) => self.raw.parent(n).map_or(ROOT, |p| Node::RawDir(p).ino()),
            _ => ROOT,
        }
    }

    pub fn stats(&self) -> &crate::stats::Stats {
        &self.prefetcher.stats
    }

    /// Whether files are handed to the kernel (FUSE passthrough): bodies are then fetched straight into
    /// memory files, and `batchfs stats` says so.
    pub fn set_passthrough(&self, on: bool) {
        self.prefetcher.fetch_into_memfds(on);
        self.prefetcher.stats.passthrough.store(u64::from(on), std::sync::atomic::Ordering::Relaxed);
    }

    /// The format of a batch file or its twin as the server sends it.
    fn batch_format(&self, index: bool) -> BatchFormat {
        match self.options.format.index() {
            Some(idx) if index => idx,
            _ => self.options.format,
        }
    }

    /// The batch and whether it is the `.idx` twin, of a batch file's name.
    fn parse_batch(&self, name: &str) -> Option<(u64, bool)> {
        let rest = name.strip_prefix("batch-")?;
        let (digits, ext) = rest.split_once('.')?;
        let batch: u64 = digits.parse().ok()?;
        if !digits.bytes().all(|b| b.is_ascii_digit()) || format!("{batch:06}") != digits || batch >= MAX_BATCHES {
            return None;
        }
        match ext {
            e if e == self.options.format.as_str() => Some((batch, false)),
            "tfrecord.idx" if self.options.format == BatchFormat::Tfrecord => Some((batch, true)),
            _ => None,
        }
    }

    /// The layout `owner` reads `rolling/` in: the indexed one holds TFRecord batches only.
    fn rolling_layout(&self, owner: u32, twin: bool) -> Layout {
        if self.options.format != BatchFormat::Tfrecord {
            return Layout::Packed;
        }
        if twin {
            self.rolling.twin_layout()
        } else {
            self.rolling.layout(owner)
        }
    }

    /// The `rolling/` file named `(batch, twin)` as `owner` sees it now: the one its next open gets, or,
    /// in the packed layout, the one it has open.
    fn rolling_node(&self, batch: u64, twin: bool, owner: u32) -> Node {
        let file = match (self.rolling_layout(owner, twin), twin) {
            (Layout::Packed, false) => RollingFile::Packed,
            (Layout::Packed, true) => RollingFile::PackedIndex,
            (Layout::Indexed, false) => RollingFile::Indexed,
            (Layout::Indexed, true) => return Node::RollingIndex { batch },
        };
        let next = self.rolling.epoch_of(batch, file);
        let held = (file != RollingFile::Indexed).then(|| self.rolling.held(batch, file, owner)).flatten();
        Node::Rolling { epoch: held.unwrap_or(next), batch, file }
    }

    /// The indexed layout's twin of `rolling/` name `batch` (the same for every epoch).
    fn rolling_index(&self, batch: u64) -> Result<Bytes, FsError> {
        self.prefetcher.slot_table()?;
        Ok(Bytes::from(self.prefetcher.file_layout(batch)?.dali_index()))
    }

    /// The sample the lookup of `name` in class `class` by thread `tid` gets, and the windows it starts.
    fn shuffled_node(&self, class: u32, name: &str, tid: u32) -> Result<Node, FsError> {
        let names = self.shuffled.names(&self.prefetcher, class)?;
        names.binary_search_by(|n| n.as_str().cmp(name)).map_err(|_| FsError::NotFound)?;
        let samples = names.len() as u64;
        if samples >= MAX_CLASS_SAMPLES {
            return Err(FsError::NotFound);
        }
        let (epoch, k) = self.shuffled.reserve(tid, class, samples).ok_or(FsError::NotFound)?;
        let plan = self.shuffled.plan(&self.prefetcher, epoch)?;
        if self.shuffled.first_time(epoch) {
            for c in 0..plan.order.len() {
                self.prefetcher.prefetch_shuffled(&plan, c, 0..WINDOW_GROUPS);
            }
        }
        // The groups holding the class's next samples, on into the next epoch's when they run past.
        let (here, next) = shuffled::window(k, plan.group as u64, samples, WINDOW_GROUPS);
        self.prefetcher.prefetch_shuffled(&plan, class as usize, here);
        if !next.is_empty() {
            let next_plan = self.shuffled.plan(&self.prefetcher, self.next_epoch(epoch))?;
            self.prefetcher.prefetch_shuffled(&next_plan, class as usize, next);
        }
        Ok(Node::Shuffled { epoch, class, k })
    }

    /// The epoch after `epoch` in the job's span (after its last, its first).
    fn next_epoch(&self, epoch: u64) -> u64 {
        let next = epoch + 1;
        if next >= self.options.first_epoch + self.options.epochs.max(1) {
            self.options.first_epoch
        } else {
            next
        }
    }

    /// At most `max` entries of class folder `class` of `shuffled/` from position `from`: its names (their
    /// inodes stand for no sample: a lookup hands one out).
    fn shuffled_entries(&self, class: u32, from: usize, max: usize) -> Result<Vec<(Node, String)>, FsError> {
        // A walk that lists the class folders looks none of them up (the listing carries their entries).
        self.shuffled.ahead(&self.prefetcher);
        let names = self.shuffled.names(&self.prefetcher, class)?;
        let epoch = self.options.first_epoch;
        let entry = |(k, n): (usize, &String)| (Node::Shuffled { epoch, class, k: k as u64 }, n.clone());
        Ok(names.iter().enumerate().skip(from).take(max).map(entry).collect())
    }

    pub fn stats_json(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec_pretty(&self.prefetcher.stats.snapshot()).expect("stats serialize");
        out.push(b'\n');
        out
    }

    /// Resolves `name` in directory `parent` for process `owner` (0: unknown; in `rolling/` the layout
    /// depends on the reader).
    pub fn lookup(&self, parent: u64, name: &str, owner: u32) -> Result<Attr, FsError> {
        self.lookup_as(parent, name, owner, owner)
    }

    /// [`Fs::lookup`] by thread `tid` of process `owner` (a name of `shuffled/` hands its thread a sample).
    pub fn lookup_as(&self, parent: u64, name: &str, owner: u32, tid: u32) -> Result<Attr, FsError> {
        crate::stats::Stats::add(&self.stats().lookups, 1);
        let node = match Node::from_ino(parent).ok_or(FsError::NotFound)? {
            Node::Root if name == META_NAME => Node::MetaDir,
            Node::Root if name == RAW_NAME && self.options.raw => Node::RawDir(0),
            Node::Root if name == ROLLING_NAME => Node::RollingDir,
            Node::Root if name == SHUFFLED_NAME && !self.shuffled.classes.is_empty() => Node::ShuffledDir,
            Node::ShuffledDir => {
                self.shuffled.ahead(&self.prefetcher);
                Node::ShuffledClass(self.shuffled.class(name).ok_or(FsError::NotFound)?)
            }
            Node::ShuffledClass(class) => self.shuffled_node(class, name, tid)?,
            Node::Root => Node::Epoch(parse_epoch(name).ok_or(FsError::NotFound)?),
            Node::MetaDir if name == "stats" => Node::Stats,
            Node::Epoch(epoch) => {
                let (batch, index) = self.parse_batch(name).ok_or(FsError::NotFound)?;
                Node::Batch { epoch, batch, index }
            }
            // The file the next open gets: the kernel asks again at every open (no entry is cached).
            Node::RollingDir => {
                let (batch, index) = self.parse_batch(name).ok_or(FsError::NotFound)?;
                self.rolling_node(batch, index, owner)
            }
            Node::RawDir(n) => {
                self.raw_listed(n)?;
                self.raw.lookup(n, name)?
            }
            Node::MetaDir => return Err(FsError::NotFound),
            Node::Stats
            | Node::Batch { .. }
            | Node::Rolling { .. }
            | Node::RollingIndex { .. }
            | Node::RawFile(_)
            | Node::Shuffled { .. } => return Err(FsError::NotADirectory),
        };
        self.attr(node)
    }

    /// Attributes of inode `ino`.
    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        self.attr(Node::from_ino(ino).ok_or(FsError::NotFound)?)
    }

    fn attr(&self, node: Node) -> Result<Attr, FsError> {
        let size = match node {
            Node::Stats => self.stats_json().len() as u64,
            Node::Batch { epoch, batch, .. }
            | Node::Rolling { epoch, batch, file: RollingFile::Packed | RollingFile::PackedIndex } => {
                let index = matches!(node, Node::Batch { index: true, .. })
                    || matches!(node, Node::Rolling { file: RollingFile::PackedIndex, .. });
                let manifest = self.prefetcher.manifest(epoch, self.batch_format(index))?;
                manifest.batches.get(batch as usize).ok_or(FsError::NotFound)?.bytes
            }
            Node::Rolling { epoch, batch, file: RollingFile::Indexed } => {
                // The batch must exist in its epoch (the manifest says), and its file is the layout's.
                let manifest = self.prefetcher.manifest(epoch, BatchFormat::Tfrecord)?;
                manifest.batches.get(batch as usize).ok_or(FsError::NotFound)?;
                self.prefetcher.slot_table()?;
                self.prefetcher.file_layout(batch)?.len
            }
            Node::RollingIndex { batch } => self.rolling_index(batch)?.len() as u64,
            Node::RawFile(n) => {
                let (dir, file) = self.raw.file(n)?;
                self.prefetcher.file_size(dir, file)?
            }
            Node::RawDir(n) => {
                if !self.options.raw || !self.raw.is_dir(n) {
                    return Err(FsError::NotFound);
                }
                0
            }
            Node::ShuffledDir if self.shuffled.classes.is_empty() => return Err(FsError::NotFound),
            Node::ShuffledClass(class) if class as usize >= self.shuffled.classes.len() => {
                return Err(FsError::NotFound)
            }
            Node::Shuffled { epoch, class, k } => {
                let plan = self.shuffled.plan(&self.prefetcher, epoch)?;
                let id = plan.order.get(class as usize).and_then(|o| o.get(k as usize)).ok_or(FsError::NotFound)?;
                self.prefetcher.sample_table()?.bytes[*id as usize]
            }
            _ => 0,
        };
        Ok(Attr { node, size })
    }

    /// The entries of directory `ino` (without `.` and `..`) as process `owner` sees them.
    pub fn readdir(&self, ino: u64, owner: u32) -> Result<Vec<(Node, String)>, FsError> {
        match Node::from_ino(ino).ok_or(FsError::NotFound)? {
            Node::Root => {
                let mut out = vec![(Node::MetaDir, META_NAME.to_owned())];
                if self.options.raw {
                    out.push((Node::RawDir(0), RAW_NAME.to_owned()));
                }
                out.push((Node::RollingDir, ROLLING_NAME.to_owned()));
                if !self.shuffled.classes.is_empty() {
                    out.push((Node::ShuffledDir, SHUFFLED_NAME.to_owned()));
                }
                out.extend((0..self.options.epochs.min(MAX_EPOCH + 1)).map(|e| (Node::Epoch(e), epoch_name(e))));
                Ok(out)
            }
            Node::MetaDir => Ok(vec![(Node::Stats, "stats".to_owned())]),
            dir @ (Node::Epoch(_) | Node::RollingDir) => self.batch_entries(dir, 0, usize::MAX, owner),
            Node::RawDir(n) => {
                self.raw_listed(n)?;
                Ok(self.raw.entries(n, 0, usize::MAX)?.into_iter().map(|(name, node)| (node, name)).collect())
            }
            // Listed, the class folders' names come with their entries (`READDIRPLUS`) and a walk looks
            // none of them up: the first listing asks ahead as the first lookup would.
            Node::ShuffledDir => {
                self.shuffled.ahead(&self.prefetcher);
                Ok(self
                    .shuffled
                    .classes
                    .iter()
                    .enumerate()
                    .map(|(c, n)| (Node::ShuffledClass(c as u32), n.clone()))
                    .collect())
            }
            Node::ShuffledClass(class) => self.shuffled_entries(class, 0, usize::MAX),
            Node::Stats
            | Node::Batch { .. }
            | Node::Rolling { .. }
            | Node::RollingIndex { .. }
            | Node::RawFile(_)
            | Node::Shuffled { .. } => Err(FsError::NotADirectory),
        }
    }

    /// At most `max` entries from position `from` of epoch directory `dir`, or of `rolling/` (one epoch's
    /// names, every epoch has as many batches, each as `owner`'s next open gets it): each batch file and
    /// its index twin, in order. Only those asked for are made.
    fn batch_entries(&self, dir: Node, from: usize, max: usize, owner: u32) -> Result<Vec<(Node, String)>, FsError> {
        let listed = match dir {
            Node::Epoch(epoch) => epoch,
            _ => self.rolling.first_epoch(),
        };
        let manifest = self.prefetcher.manifest(listed, self.options.format)?;
        let per = if self.options.format.index().is_some() { 2 } else { 1 };
        let total = manifest.batches.len() * per;
        let entry = |i: usize| {
            let (batch, index) = ((i / per) as u64, i % per == 1);
            let node = match dir {
                Node::Epoch(epoch) => Node::Batch { epoch, batch, index },
                _ => self.rolling_node(batch, index, owner),
            };
            (node, batch_name(batch, self.batch_format(index)))
        };
        Ok((from.min(total)..total.min(from.saturating_add(max))).map(entry).collect())
    }

    /// Every entry of directory `ino` as `readdir` returns it: `.`, `..`, then [`Fs::readdir`]'s, each as
    /// (inode, is a directory, name).
    pub fn dir_entries(&self, ino: u64, owner: u32) -> Result<Vec<(u64, bool, String)>, FsError> {
        self.dir_entries_from(ino, 0, owner)
    }

    /// [`Fs::dir_entries`] from position `offset` on: all of them, except in a directory of `raw/`, an
    /// epoch directory or `rolling/`, where a call gives at most [`READDIR_BATCH`] (the kernel asks again
    /// from where it got to), so listing a directory of a million files costs each entry once, not the
    /// whole directory per call.
    pub fn dir_entries_from(&self, ino: u64, offset: usize, owner: u32) -> Result<Vec<(u64, bool, String)>, FsError> {
        let dots = [(ino, true, ".".to_owned()), (self.parent(ino), true, "..".to_owned())];
        let entries = match Node::from_ino(ino) {
            Some(Node::RawDir(n)) => {
                self.raw_listed(n)?;
                self.raw.entries(n, offset.saturating_sub(2), READDIR_BATCH)?
            }
            Some(dir @ (Node::Epoch(_) | Node::RollingDir)) => {
                let entries = self.batch_entries(dir, offset.saturating_sub(2), READDIR_BATCH, owner)?;
                entries.into_iter().map(|(node, name)| (name, node)).collect()
            }
            Some(Node::ShuffledClass(class)) => {
                let entries = self.shuffled_entries(class, offset.saturating_sub(2), READDIR_BATCH)?;
                entries.into_iter().map(|(node, name)| (name, node)).collect()
            }
            _ => {
                let entries = self.readdir(ino, owner)?.into_iter().map(|(node, name)| (name, node));
                entries.skip(offset.saturating_sub(2)).collect()
            }
        };
        let mut out: Vec<(u64, bool, String)> = dots.into_iter().skip(offset).collect();
        out.extend(entries.into_iter().map(|(name, n)| (n.ino(), n.is_dir(), name)));
        Ok(out)
    }

    /// Checks that `ino` can be opened for reading. [`Fs::opened`] says when the open got its file.
    pub fn open(&self, ino: u64, write: bool) -> Result<Node, FsError> {
        let node = Node::from_ino(ino).ok_or(FsError::NotFound)?;
        if write {
            return Err(FsError::ReadOnly);
        }
        Ok(node)
    }

    /// An open of `ino` by process `owner` succeeded. An open of a `rolling/` file moves its name on (its
    /// next lookup, the next open's, is the following epoch's file); an open of a twin there makes
    /// `owner` an index-driven reader (with `rolling=auto`). A failed open moves nothing.
    pub fn opened(&self, ino: u64, owner: u32) {
        self.opened_as(ino, owner, owner)
    }

    /// [`Fs::opened`] by thread `tid` of process `owner`: a sample of `shuffled/` is the thread's file now.
    pub fn opened_as(&self, ino: u64, owner: u32, tid: u32) {
        match Node::from_ino(ino) {
            Some(Node::Shuffled { epoch, class, k }) => self.shuffled.opened(tid, class, epoch, k),
            Some(Node::Rolling { epoch, batch, file }) => {
                self.rolling.opened(batch, file, epoch);
                if file != RollingFile::Indexed {
                    self.rolling.hold(batch, file, epoch, owner);
                }
                if file == RollingFile::PackedIndex {
                    self.rolling.reads_twins(owner);
                }
            }
            Some(Node::RollingIndex { .. }) => self.rolling.reads_twins(owner),
            _ => {}
        }
    }

    /// Process `owner` released a handle of `ino` that [`Fs::opened`] counted.
    pub fn released(&self, ino: u64, owner: u32) {
        if let Some(Node::Rolling { epoch, batch, file: file @ (RollingFile::Packed | RollingFile::PackedIndex) }) =
            Node::from_ino(ino)
        {
            self.rolling.release(batch, file, epoch, owner);
        }
    }

    /// What file `ino` reads.
    fn source(&self, ino: u64) -> Result<Source, FsError> {
        match Node::from_ino(ino).ok_or(FsError::NotFound)? {
            Node::Batch { epoch, batch, index } => {
                Ok(Source::Batch(ObjectKey::batch(epoch, batch, self.batch_format(index))))
            }
            Node::Rolling { epoch, batch, file: RollingFile::Packed } => {
                Ok(Source::Batch(ObjectKey::batch(epoch, batch, self.batch_format(false))))
            }
            Node::Rolling { epoch, batch, file: RollingFile::PackedIndex } => {
                Ok(Source::Batch(ObjectKey::batch(epoch, batch, self.batch_format(true))))
            }
            Node::Rolling { epoch, batch, file: RollingFile::Indexed } => {
                Ok(Source::Batch(ObjectKey { listing: Listing::Rolling { epoch }, index: batch }))
            }
            Node::RollingIndex { batch } => Ok(Source::RollingIndex(batch)),
            Node::RawFile(n) => {
                let (dir, file) = self.raw.file(n)?;
                Ok(Source::Raw { dir, file })
            }
            Node::Shuffled { epoch, class, k } => Ok(Source::Shuffled { epoch, class, k }),
            Node::Stats => Err(FsError::NotFound),
            _ => Err(FsError::IsADirectory),
        }
    }

    /// Reads `size` bytes at `offset` of file `ino` for the reading process `owner`.
    pub fn read(&self, ino: u64, offset: u64, size: u32, owner: u32) -> Result<Bytes, FsError> {
        Ok(match self.source(ino)? {
            Source::Batch(key) => self.prefetcher.read(key, offset, size, owner)?,
            Source::Raw { dir, file } => self.prefetcher.read_file(dir, file, offset, size, owner)?,
            Source::RollingIndex(batch) => {
                let text = self.rolling_index(batch)?;
                let start = (offset as usize).min(text.len());
                text.slice(start..(start + size as usize).min(text.len()))
            }
            Source::Shuffled { epoch, class, k } => {
                let plan = self.shuffled.plan(&self.prefetcher, epoch)?;
                self.prefetcher.read_shuffled(&plan, class as usize, k, offset, size, owner)?
            }
        })
    }

    /// The verified contents of file `ino` for the kernel to serve (FUSE passthrough): with `disk`, a
    /// `raw/` file the node cache holds, its file there (checked, never copied into memory); else a sealed
    /// memory file, waited for like a read by `owner` does. `None` for a file read through the daemon: a
    /// source file of more than one chunk (read chunk by chunk, never held whole), a sample of `shuffled/`
    /// (part of its group, and a memory file of its own per open cost more than the reads it saves).
    pub fn backing_file(&self, ino: u64, owner: u32, disk: bool) -> Result<Option<Backing>, FsError> {
        let in_memory = |file| Ok(Some(Backing { file, on_disk: false }));
        let key = match self.source(ino)? {
            Source::Batch(key) => key,
            Source::Shuffled { .. } => return Ok(None),
            Source::Raw { dir, file } => {
                let chunks = self.prefetcher.file_chunks(dir, file)?;
                if chunks.end - chunks.start != 1 {
                    return Ok(None);
                }
                let key = ObjectKey { listing: Listing::Raw { dir }, index: chunks.start };
                if disk {
                    if let Some(file) = self.prefetcher.disk_backing(key)? {
                        return Ok(Some(Backing { file, on_disk: true }));
                    }
                }
                key
            }
            Source::RollingIndex(batch) => {
                let text = self.rolling_index(batch)?;
                let file = crate::sys::memfd("batchfs-index")
                    .and_then(|mut f| std::io::Write::write_all(&mut f, &text).and_then(|_| crate::sys::seal(f)))
                    .map_err(|e| FsError::Io(ReadError::Backing(format!("the twin of rolling/ batch {batch}: {e}"))))?;
                return in_memory(Arc::new(file));
            }
        };
        in_memory(self.prefetcher.backing_file(key, owner)?)
    }

    /// The last handle of file `ino` was closed.
    pub fn closed(&self, ino: u64) {
        match self.source(ino) {
            Ok(Source::Batch(key)) => self.prefetcher.closed(key),
            Ok(Source::Raw { dir, file }) => {
                for index in self.prefetcher.file_chunks(dir, file).unwrap_or_default() {
                    self.prefetcher.closed(ObjectKey { listing: Listing::Raw { dir }, index });
                }
            }
            // A group is consumed once its last sample is read to its end (the prefetcher marks it).
            Ok(Source::RollingIndex(_) | Source::Shuffled { .. }) | Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::MemoryClient;
    use crate::prefetch::PrefetcherConfig;
    use proptest::prelude::*;

    /// The source files of the test dataset; each holds `contents of {path}`.
    const RAW_FILES: [&str; 5] = ["a/x.jpg", "a/y.jpg", "b/c/z.jpg", "s", "top.txt"];

    fn fs(format: BatchFormat) -> (tokio::runtime::Runtime, Fs) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|epoch, f| {
            (0..3).map(|b| Bytes::from(format!("{f} epoch {epoch} batch {b}").into_bytes())).collect()
        });
        client.files =
            RAW_FILES.iter().map(|p| (p.to_string(), Bytes::from(format!("contents of {p}").into_bytes()))).collect();
        // Small chunks: every file but `s` is fetched in two ranges, and reads cross chunks.
        client.chunk_bytes = 16;
        let p = Prefetcher::new(Arc::new(client), rt.handle().clone(), PrefetcherConfig::default());
        (rt, Fs::new(p, options(format)))
    }

    fn options(format: BatchFormat) -> FsOptions {
        FsOptions {
            epochs: 2,
            format,
            uid: 0,
            gid: 0,
            time: SystemTime::UNIX_EPOCH,
            raw: true,
            rolling: RollingMode::Packed,
            first_epoch: 0,
            classes: vec![],
        }
    }

    /// A class-folder tree of `per_class[c]` files in class `c` (`c0/f000.jpg`...), each holding its own
    /// path, as a mount of `share` sees it through `shuffled/`.
    fn class_tree(per_class: &[usize], share: (u32, u32)) -> (tokio::runtime::Runtime, Fs, Vec<(String, Bytes)>) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|_, _| vec![]);
        for (c, &n) in per_class.iter().enumerate() {
            for i in 0..n {
                let path = format!("c{c}/f{i:03}.jpg");
                let body = format!("{path}:{}", "x".repeat(i * 37 % 200));
                client.files.push((path, Bytes::from(body.into_bytes())));
            }
        }
        let files = client.files.clone();
        let classes: Vec<String> = (0..per_class.len()).map(|c| format!("c{c}")).collect();
        let mut config = PrefetcherConfig::default();
        config.shuffled.share = share;
        let p = Prefetcher::new(Arc::new(client), rt.handle().clone(), config);
        (rt, Fs::new(p, FsOptions { classes, epochs: 3, ..options(BatchFormat::Tfrecord) }), files)
    }

    /// Every name of every class opened once by one of four threads, in a random order: the bytes of each
    /// class's files, each exactly once per epoch, in a new order each epoch; `stat` says each one's size.
    #[test]
    fn each_open_in_shuffled_gets_the_next_sample_of_its_class_once_an_epoch() {
        let (_rt, fs, files) = class_tree(&[5, 9, 1], (0, 1));
        let root: Vec<String> = fs.readdir(ROOT, 0).unwrap().into_iter().map(|(_, n)| n).collect();
        assert!(root.contains(&"shuffled".to_owned()), "{root:?}");
        let dir = fs.lookup(ROOT, "shuffled", 0).unwrap().node;
        let classes: Vec<String> = fs.readdir(dir.ino(), 0).unwrap().into_iter().map(|(_, n)| n).collect();
        assert_eq!(classes, ["c0", "c1", "c2"]);
        let mut orders = Vec::new();
        for epoch in 0..2 {
            let mut got: Vec<(usize, Vec<u8>)> = Vec::new();
            let mut names = Vec::new();
            for (c, class) in classes.iter().enumerate() {
                let class_ino = fs.lookup(dir.ino(), class, 0).unwrap().node.ino();
                let listed = fs.dir_entries(class_ino, 0).unwrap();
                names.extend(listed[2..].iter().map(|e| (c, class_ino, e.2.clone())));
            }
            // A shuffled walk, as a sampler's: four threads taking turns.
            let mut rng = batchfs::plan::SplitMix64::new(epoch);
            for i in (1..names.len()).rev() {
                names.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            for (i, (c, class_ino, name)) in names.iter().enumerate() {
                let tid = 100 + (i % 4) as u32;
                let attr = fs.lookup_as(*class_ino, name, 7, tid).unwrap();
                assert_eq!(fs.lookup_as(*class_ino, name, 7, tid).unwrap(), attr, "looked up again: the same");
                fs.opened_as(attr.node.ino(), 7, tid);
                let body = fs.read(attr.node.ino(), 0, 1 << 20, 7).unwrap();
                assert_eq!(body.len() as u64, attr.size);
                got.push((*c, body.to_vec()));
            }
            // Every group of the epoch read whole has left the memory cache at once.
            let groups: usize = fs.shuffled.plan(&fs.prefetcher, epoch).unwrap().groups.iter().map(Vec::len).sum();
            let evicted = fs.prefetcher.stats.snapshot().evictions;
            assert!(evicted >= (groups * (epoch as usize + 1)) as u64, "{evicted} evicted of {groups} groups an epoch");
            for (c, _) in classes.iter().enumerate() {
                let mut mine: Vec<&[u8]> = got.iter().filter(|g| g.0 == c).map(|g| &g.1[..]).collect();
                let mut want: Vec<&[u8]> =
                    files.iter().filter(|f| f.0.starts_with(&format!("c{c}/"))).map(|f| &f.1[..]).collect();
                orders.push(mine.iter().map(|b| b.to_vec()).collect::<Vec<_>>());
                mine.sort();
                want.sort();
                assert_eq!(mine, want, "class {c}, epoch {epoch}: each of its samples once");
            }
        }
        assert_ne!(orders[1], orders[4], "class 1's order differs between epochs");
        assert_eq!(fs.lookup(dir.ino(), "c9", 0).unwrap_err().errno(), libc::ENOENT);
        let c0 = fs.lookup(dir.ino(), "c0", 0).unwrap().node.ino();
        assert_eq!(fs.lookup(c0, "nope.jpg", 0).unwrap_err().errno(), libc::ENOENT);
    }

    /// Two mounts of shares 0/2 and 1/2: each shows half of each class's names and serves half of its
    /// samples; together every sample once.
    #[test]
    fn shares_of_shuffled_split_every_class() {
        let mut all: Vec<Vec<u8>> = Vec::new();
        let mut files = Vec::new();
        for rank in 0..2 {
            let (_rt, fs, f) = class_tree(&[7, 4], (rank, 2));
            files = f;
            let dir = fs.lookup(ROOT, "shuffled", 0).unwrap().node.ino();
            for class in ["c0", "c1"] {
                let class_ino = fs.lookup(dir, class, 0).unwrap().node.ino();
                let names: Vec<String> =
                    fs.dir_entries(class_ino, 0).unwrap()[2..].iter().map(|e| e.2.clone()).collect();
                let total = if class == "c0" { 7 } else { 4 };
                assert_eq!(names.len(), (total + 1 - rank as usize) / 2, "{class} of rank {rank}");
                for name in names {
                    let attr = fs.lookup_as(class_ino, &name, 1, 1).unwrap();
                    fs.opened_as(attr.node.ino(), 1, 1);
                    all.push(fs.read(attr.node.ino(), 0, 1 << 20, 1).unwrap().to_vec());
                }
            }
        }
        let mut want: Vec<Vec<u8>> = files.iter().map(|f| f.1.to_vec()).collect();
        all.sort();
        want.sort();
        assert_eq!(all, want);
    }

    #[test]
    fn tree_and_reads() {
        let (_rt, fs) = fs(BatchFormat::Tfrecord);
        let names: Vec<String> = fs.readdir(ROOT, 0).unwrap().into_iter().map(|(_, n)| n).collect();
        assert_eq!(names, [".batchfs", "raw", "rolling", "epoch-0000", "epoch-0001"]);
        let e7 = fs.lookup(ROOT, "epoch-0007", 0).unwrap();
        assert_eq!(e7.node, Node::Epoch(7), "unlisted epochs resolve by name");
        let listing: Vec<String> = fs.readdir(e7.node.ino(), 0).unwrap().into_iter().map(|(_, n)| n).collect();
        assert_eq!(listing[..2], ["batch-000000.tfrecord", "batch-000000.tfrecord.idx"]);
        let f = fs.lookup(e7.node.ino(), "batch-000002.tfrecord", 0).unwrap();
        let want = "tfrecord epoch 7 batch 2";
        assert_eq!(f.size, want.len() as u64);
        assert_eq!(fs.read(f.node.ino(), 0, 100, 1).unwrap(), want.as_bytes());
        let idx = fs.lookup(e7.node.ino(), "batch-000002.tfrecord.idx", 0).unwrap();
        assert_eq!(fs.read(idx.node.ino(), 0, 100, 1).unwrap(), "tfrecord.idx epoch 7 batch 2".as_bytes());
        assert_eq!(fs.lookup(META_DIR, "stats", 0).unwrap().node, Node::Stats);
        let json: serde_json::Value = serde_json::from_slice(&fs.stats_json()).unwrap();
        assert_eq!(json["reads"], 2);
    }

    #[test]
    fn each_open_of_a_rolling_name_serves_the_next_epoch_of_that_file() {
        let (rt, mut fs) = fs(BatchFormat::Tfrecord);
        fs.options.first_epoch = 5;
        fs.options.epochs = 4;
        // The epochs it serves are the span's: 5 to 8, then 5 again.
        let fs = Fs::new(fs.prefetcher.clone(), fs.options.clone());
        let _rt = rt;
        let rolling = fs.lookup(ROOT, "rolling", 0).unwrap().node;
        assert_eq!(rolling, Node::RollingDir);
        let names: Vec<String> = fs.readdir(rolling.ino(), 0).unwrap().into_iter().map(|(_, n)| n).collect();
        assert_eq!(names[..2], ["batch-000000.tfrecord", "batch-000000.tfrecord.idx"]);
        assert_eq!(names.len(), 6);
        let open = |name: &str| {
            let attr = fs.lookup(rolling.ino(), name, 0).unwrap();
            fs.open(attr.node.ino(), false).unwrap();
            fs.opened(attr.node.ino(), 0);
            let body = fs.read(attr.node.ino(), 0, 100, 1).unwrap();
            fs.closed(attr.node.ino());
            assert_eq!(attr.size, body.len() as u64);
            String::from_utf8(body.to_vec()).unwrap()
        };
        // Looking a name up (stat, ls) moves nothing; each open that got its file does, per name.
        fs.lookup(rolling.ino(), "batch-000001.tfrecord", 0).unwrap();
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord epoch 5 batch 1");
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord epoch 6 batch 1");
        assert_eq!(open("batch-000002.tfrecord"), "tfrecord epoch 5 batch 2");
        assert_eq!(open("batch-000001.tfrecord.idx"), "tfrecord.idx epoch 5 batch 1");
        let failed = fs.lookup(rolling.ino(), "batch-000001.tfrecord", 0).unwrap();
        fs.open(failed.node.ino(), false).unwrap();
        // (No `opened`: the open failed, as a passthrough open whose fetch fails does.)
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord epoch 7 batch 1", "a failed open skips nothing");
        // readdir names each file at the epoch its next open gets.
        let listed = fs.readdir(rolling.ino(), 0).unwrap();
        let epoch_of = |name: &str| match listed.iter().find(|(_, n)| n == name).unwrap().0 {
            Node::Rolling { epoch, .. } => epoch,
            other => panic!("{other:?}"),
        };
        assert_eq!((epoch_of("batch-000001.tfrecord"), epoch_of("batch-000000.tfrecord")), (8, 5));
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord epoch 8 batch 1");
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord epoch 5 batch 1", "the span's first epoch again");
        // Two opens of one looked-up file (two readers that resolved it together) share its epoch.
        let attr = fs.lookup(rolling.ino(), "batch-000000.tfrecord", 0).unwrap();
        for _ in 0..2 {
            fs.open(attr.node.ino(), false).unwrap();
            fs.opened(attr.node.ino(), 0);
        }
        assert_eq!(open("batch-000000.tfrecord"), "tfrecord epoch 6 batch 0");
        assert_eq!(fs.lookup(rolling.ino(), "batch-000003.tfrecord", 0).unwrap_err().errno(), libc::ENOENT);
        assert_eq!(fs.parent(rolling.ino()), ROOT);
    }

    /// The TFRecord frame of record `r` of batch `b` of epoch `e`: sizes differ between epochs, with a
    /// heavy tail (one record in seven twenty times the others).
    fn frame(e: u64, b: u64, r: u64) -> Vec<u8> {
        let len = 200 + ((e * 31 + b * 17 + r * 7) % 13) * 50 + if (e + b + r).is_multiple_of(7) { 5000 } else { 0 };
        let mut out = Vec::new();
        batchfs::tfrecord::encode_record(&vec![(e * 100 + b * 10 + r) as u8; len as usize], &mut out);
        out
    }

    /// rolling/ in the indexed layout: each name is one file whose size and twin hold for every epoch of
    /// the span; each epoch's file holds exactly that epoch's records, each at the offset its twin gives
    /// (at most its slot long), zeros between them, which a memory file for the kernel does not store.
    #[test]
    fn indexed_rolling_files_hold_each_epochs_records_at_the_twins_offsets() {
        for memfds in [false, true] {
            indexed_rolling_files_hold_each_epochs_records(memfds);
        }
    }

    /// The test above, with bodies fetched into buffers or (passthrough) placed into memory files.
    fn indexed_rolling_files_hold_each_epochs_records(memfds: bool) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let records = |e: u64, b: u64| (0..5).map(|r| frame(e, b, r)).collect::<Vec<_>>();
        let client = MemoryClient::new(move |e, f| {
            (0..3)
                .map(|b| match f {
                    BatchFormat::Tfrecord => Bytes::from(records(e, b).concat()),
                    _ => Bytes::from(format!("{f} epoch {e} batch {b}").into_bytes()),
                })
                .collect()
        });
        let config = PrefetcherConfig { rolling: (4, 3), last_epoch: 6, ..PrefetcherConfig::default() };
        let p = Prefetcher::new(Arc::new(client), rt.handle().clone(), config);
        p.fetch_into_memfds(memfds);
        let o =
            FsOptions { rolling: RollingMode::Indexed, first_epoch: 4, epochs: 3, ..options(BatchFormat::Tfrecord) };
        let fs = Fs::new(p.clone(), o);
        let rolling = fs.lookup(ROOT, "rolling", 0).unwrap().node.ino();
        let twin_of = |b: u64| {
            let twin = fs.lookup(rolling, &format!("batch-{b:06}.tfrecord.idx"), 0).unwrap();
            assert_eq!(twin.node, Node::RollingIndex { batch: b });
            let text = fs.read(twin.node.ino(), 0, 1 << 20, 1).unwrap();
            assert_eq!(text.len() as u64, twin.size);
            let lines = String::from_utf8(text.to_vec()).unwrap();
            lines
                .lines()
                .map(|l| l.split_once(' ').map(|(o, s)| (o.parse().unwrap(), s.parse().unwrap())).unwrap())
                .collect::<Vec<(u64, u64)>>()
        };
        let twins: Vec<Vec<(u64, u64)>> = (0..3).map(twin_of).collect();
        // Four passes: epochs 4, 5, 6, then 4 again.
        for (pass, epoch) in [4, 5, 6, 4].into_iter().enumerate() {
            for b in 0..3u64 {
                let attr = fs.lookup(rolling, &format!("batch-{b:06}.tfrecord"), 0).unwrap();
                assert_eq!(attr.node, Node::Rolling { epoch, batch: b, file: RollingFile::Indexed }, "pass {pass}");
                let (last_offset, last_slot) = *twins[b as usize].last().unwrap();
                assert_eq!(attr.size, last_offset + last_slot, "one size for every epoch");
                fs.open(attr.node.ino(), false).unwrap();
                fs.opened(attr.node.ino(), 0);
                let file = fs.read(attr.node.ino(), 0, 1 << 20, 1).unwrap();
                assert_eq!(file.len() as u64, attr.size);
                let mut found = Vec::new();
                let mut zeros = file.to_vec();
                for &(offset, slot) in &twins[b as usize] {
                    let at = offset as usize;
                    let len = u64::from_le_bytes(file[at..at + 8].try_into().unwrap()) as usize + 16;
                    assert!(len as u64 <= slot, "a record within its slot");
                    found.push(file[at..at + len].to_vec());
                    zeros[at..at + len].fill(0);
                }
                assert!(zeros.iter().all(|&z| z == 0), "zeros between the records");
                let mut want = records(epoch, b);
                want.sort();
                found.sort();
                assert_eq!(found, want, "epoch {epoch} batch {b}: exactly its records");
                // Reads across records and holes, and the memory file the kernel would serve.
                assert_eq!(fs.read(attr.node.ino(), 100, 9000, 1).unwrap(), file.slice(100..(9100).min(file.len())));
                use std::os::unix::fs::{FileExt, MetadataExt};
                let backing = fs.backing_file(attr.node.ino(), 1, true).unwrap().unwrap().file;
                let mut in_file = vec![7u8; file.len()];
                backing.read_exact_at(&mut in_file, 0).unwrap();
                assert!(in_file == file, "the memory file holds the same bytes");
                let stored = backing.metadata().unwrap().blocks() * 512;
                let real: u64 = want.iter().map(|r| r.len() as u64).sum();
                assert!(stored <= real.next_multiple_of(4096) + 2 * 4096 * 5, "holes: {stored} bytes for {real}");
                fs.closed(attr.node.ino());
            }
        }
        assert_eq!(twins, (0..3).map(twin_of).collect::<Vec<_>>(), "the twins are the same every epoch");
        // What the cache is charged for a placed file: its records, and the two pages each shares with the
        // holes around it; never the holes.
        let charged = p.cache_used();
        let placed: u64 = (4..7)
            .flat_map(|e| (0..3).map(move |b| (e, b)))
            .map(|(e, b)| records(e, b).concat().len() as u64 + 2 * 4096 * 5)
            .sum();
        assert!(charged <= placed, "{charged} charged for {placed}");
        let s = p.stats.snapshot();
        assert_eq!((s.checksum_errors, s.errors), (0, 0), "{s:?}");
        assert!(!memfds || s.passthrough_bytes > 0, "placed into memory files as they came: {s:?}");
    }

    /// `raw/` lists a directory when a lookup or a listing first looks into it, every page of it, and
    /// no other; a large directory is read back in `readdir` calls of at most [`READDIR_BATCH`].
    #[test]
    fn raw_directories_are_listed_when_first_looked_into() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|_, _| vec![]);
        client.files = (0..10_000).map(|i| (format!("big/f{i:05}"), Bytes::from_static(b"x"))).collect();
        client.files.push(("other/y".into(), Bytes::from_static(b"y")));
        client.page = 3000;
        let client = Arc::new(client);
        let p = Prefetcher::new(client.clone(), rt.handle().clone(), PrefetcherConfig::default());
        let fs = Fs::new(p, options(BatchFormat::Tfrecord));
        let raw = fs.lookup(ROOT, "raw", 0).unwrap().node;
        assert!(client.listed.lock().unwrap().is_empty(), "nothing is listed before it is looked into");
        let big = fs.lookup(raw.ino(), "big", 0).unwrap().node;
        let f = fs.lookup(big.ino(), "f04321", 0).unwrap();
        assert_eq!(fs.read(f.node.ino(), 0, 10, 1).unwrap(), Bytes::from_static(b"x"));
        let listed: Vec<String> = client.listed.lock().unwrap().iter().map(|(d, _)| d.clone()).collect();
        assert!(listed.iter().all(|d| d.is_empty() || d == "big"), "{listed:?}");
        assert_eq!(listed.iter().filter(|d| *d == "big").count(), 4, "four pages of 3,000: {listed:?}");
        // readdir from each offset the kernel asks for: every entry once, in calls of at most a batch.
        let mut names = Vec::new();
        let mut offset = 0;
        loop {
            let got = fs.dir_entries_from(big.ino(), offset, 0).unwrap();
            if got.is_empty() {
                break;
            }
            assert!(got.len() <= READDIR_BATCH + 2);
            offset += got.len();
            names.extend(got.into_iter().map(|e| e.2));
        }
        assert_eq!(names.len(), 10_002);
        assert_eq!(
            (&names[..3], names.last().unwrap().as_str()),
            (&[".".into(), "..".into(), "f00000".into()][..], "f09999")
        );
        assert_eq!(fs.parent(big.ino()), raw.ino());
        assert!(!client.listed.lock().unwrap().iter().any(|(d, _)| d == "other"), "never looked into");
    }

    /// A walk into a second subdirectory of a directory lists the others ahead (once each, even when the
    /// walk gets to one while it is being listed).
    #[test]
    fn a_walk_lists_the_next_directories_ahead() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|_, _| vec![]);
        client.files = (0..20).map(|d| (format!("c{d:02}/f.jpg"), Bytes::from_static(b"x"))).collect();
        let client = Arc::new(client);
        let p = Prefetcher::new(client.clone(), rt.handle().clone(), PrefetcherConfig::default());
        let fs = Fs::new(p, options(BatchFormat::Tfrecord));
        let raw = fs.lookup(ROOT, "raw", 0).unwrap().node;
        let pages = || client.listed.lock().unwrap().clone();
        let listed = || {
            let mut dirs: Vec<String> = pages().into_iter().map(|(d, _)| d).collect();
            dirs.dedup();
            dirs
        };
        for (i, dir) in ["c00", "c01"].iter().enumerate() {
            let node = fs.lookup(raw.ino(), dir, 0).unwrap().node;
            fs.readdir(node.ino(), 0).unwrap();
            if i == 0 {
                std::thread::sleep(std::time::Duration::from_millis(50));
                assert_eq!(listed(), ["", "c00"], "one look lists nothing more");
            }
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while listed().len() < 21 {
            assert!(std::time::Instant::now() < deadline, "{:?}", listed());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        for d in 2..20 {
            let node = fs.lookup(raw.ino(), &format!("c{d:02}"), 0).unwrap().node;
            assert_eq!(fs.readdir(node.ino(), 0).unwrap().len(), 1);
        }
        let mut all = pages();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), pages().len(), "each page of each directory asked for once: {:?}", pages());
    }

    /// An epoch directory (and `rolling/`) of many batches is read back by `readdir` offsets a bounded
    /// batch of entries per call, each entry made once: building all of them at every call made listing
    /// an epoch of N batches cost N²/100.
    #[test]
    fn large_epoch_directories_are_listed_a_batch_of_entries_per_call() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let client = MemoryClient::new(|_, _| (0..6000).map(|_| Bytes::from_static(b"x")).collect());
        let p = Prefetcher::new(Arc::new(client), rt.handle().clone(), PrefetcherConfig::default());
        let fs = Fs::new(p, options(BatchFormat::Tfrecord));
        for dir in [Node::Epoch(3).ino(), ROLLING_DIR] {
            let mut names = Vec::new();
            let mut offset = 0;
            loop {
                let got = fs.dir_entries_from(dir, offset, 0).unwrap();
                if got.is_empty() {
                    break;
                }
                assert!(got.len() <= READDIR_BATCH + 2, "{} entries in one call", got.len());
                offset += got.len();
                names.extend(got.into_iter().map(|e| e.2));
            }
            assert_eq!(names.len(), 2 + 12_000, "every batch and twin once");
            assert_eq!((&names[2][..], &names[12_001][..]), ("batch-000000.tfrecord", "batch-005999.tfrecord.idx"));
        }
    }

    #[test]
    fn raw_tree_shows_the_source_files() {
        let (_rt, fs) = fs(BatchFormat::Tar);
        let raw = fs.lookup(ROOT, "raw", 0).unwrap().node;
        let top: Vec<String> = fs.readdir(raw.ino(), 0).unwrap().into_iter().map(|(_, n)| n).collect();
        assert_eq!(top, ["a", "b", "s", "top.txt"]);
        let b = fs.lookup(raw.ino(), "b", 0).unwrap().node;
        let c = fs.lookup(b.ino(), "c", 0).unwrap().node;
        assert!(c.is_dir());
        // `..` of a directory deep in raw/ is its parent (it once was the directory itself).
        let dots = |ino| fs.dir_entries(ino, 0).unwrap()[..2].to_vec();
        assert_eq!(dots(c.ino()), [(c.ino(), true, ".".to_owned()), (b.ino(), true, "..".to_owned())]);
        assert_eq!(dots(b.ino())[1].0, raw.ino());
        assert_eq!(dots(raw.ino())[1].0, ROOT);
        assert_eq!(dots(ROOT)[1].0, ROOT);
        assert_eq!(dots(Node::Epoch(1).ino())[1].0, ROOT);
        let listed: Vec<String> = fs.dir_entries(c.ino(), 0).unwrap().into_iter().map(|e| e.2).collect();
        assert_eq!(listed, [".", "..", "z.jpg"]);
        let z = fs.lookup(c.ino(), "z.jpg", 0).unwrap();
        assert_eq!(z.size, "contents of b/c/z.jpg".len() as u64);
        assert_eq!(fs.read(z.node.ino(), 0, 1000, 1).unwrap(), "contents of b/c/z.jpg".as_bytes());
        assert_eq!(fs.read(z.node.ino(), 9, 4, 1).unwrap(), "of b".as_bytes());
        // Across the boundary of its two 16-byte chunks, and from the second alone.
        assert_eq!(fs.read(z.node.ino(), 12, 8, 1).unwrap(), "b/c/z.jp".as_bytes());
        assert_eq!(fs.read(z.node.ino(), 17, 100, 1).unwrap(), ".jpg".as_bytes());
        assert_eq!(fs.read(z.node.ino(), 21, 100, 1).unwrap(), "".as_bytes());
        assert_eq!(fs.lookup(raw.ino(), "nope", 0).unwrap_err().errno(), libc::ENOENT);
        assert_eq!(fs.lookup(z.node.ino(), "x", 0).unwrap_err().errno(), libc::ENOTDIR);
    }

    #[test]
    fn errors_map_to_errnos() {
        let (_rt, fs) = fs(BatchFormat::Tar);
        let e0 = Node::Epoch(0).ino();
        for missing in ["batch-000003.tar", "batch-000000.tfrecord", "batch-0.tar", "batch-0000001.tar", "x"] {
            assert_eq!(fs.lookup(e0, missing, 0).unwrap_err().errno(), libc::ENOENT, "{missing}");
        }
        for bad in ["epoch-1", "epoch-00001", "epoch-1000000", "epoch-+001", "nothing"] {
            assert_eq!(fs.lookup(ROOT, bad, 0).unwrap_err().errno(), libc::ENOENT, "{bad}");
        }
        let file = fs.lookup(e0, "batch-000000.tar", 0).unwrap().node.ino();
        assert_eq!(fs.lookup(file, "x", 0).unwrap_err().errno(), libc::ENOTDIR);
        assert_eq!(fs.open(file, true).unwrap_err().errno(), libc::EROFS);
        assert_eq!(fs.read(e0, 0, 10, 1).unwrap_err().errno(), libc::EISDIR);
        assert_eq!(fs.getattr(12345).unwrap_err().errno(), libc::ENOENT);
    }

    /// Resolves `path` from the root for process `owner`: its inode.
    fn resolve(fs: &Fs, path: &str, owner: u32) -> u64 {
        path.split('/').fold(ROOT, |dir, name| fs.lookup(dir, name, owner).unwrap().node.ino())
    }

    /// A new worker (a new `Fs` over the same ledger) numbers every view as the last one did, whatever
    /// order it is asked in: `raw/` walked in another order, `rolling/` names at the epochs the last worker
    /// moved them to, epoch directories, `.batchfs`.
    #[test]
    fn a_new_worker_numbers_every_view_as_the_last_one_did() {
        let ledger = Arc::new(crate::ledger::Ledger::create().unwrap());
        let (_rt, mut old) = fs(BatchFormat::Tfrecord);
        old.record_in(ledger.clone());
        let paths = [
            "raw/b/c/z.jpg",
            "raw/top.txt",
            "raw/a/y.jpg",
            "raw/a",
            ".batchfs/stats",
            "epoch-0001/batch-000002.tfrecord",
        ];
        let inos: Vec<u64> = paths.iter().map(|p| resolve(&old, p, 0)).collect();
        // rolling/: batch 0 opened twice (at epoch 1 next), batch 1 once.
        for name in ["batch-000000.tfrecord", "batch-000000.tfrecord", "batch-000001.tfrecord"] {
            let ino = resolve(&old, &format!("rolling/{name}"), 0);
            old.opened(ino, 0);
        }
        let rolling: Vec<u64> = (0..3).map(|b| resolve(&old, &format!("rolling/batch-{b:06}.tfrecord"), 0)).collect();
        drop(old);

        let (_rt, mut new) = fs(BatchFormat::Tfrecord);
        new.record_in(ledger);
        // The kernel holds the inodes: asked first by number, before any lookup.
        assert_eq!(new.getattr(inos[0]).unwrap().size, "contents of b/c/z.jpg".len() as u64);
        let mut again: Vec<(usize, u64)> =
            paths.iter().enumerate().rev().map(|(i, p)| (i, resolve(&new, p, 0))).collect();
        again.reverse();
        assert_eq!(again.into_iter().map(|(_, ino)| ino).collect::<Vec<_>>(), inos);
        let now: Vec<u64> = (0..3).map(|b| resolve(&new, &format!("rolling/batch-{b:06}.tfrecord"), 0)).collect();
        assert_eq!(now, rolling, "each rolling/ name at the epoch the last worker moved it to");
        assert_eq!(Node::from_ino(now[0]), Some(Node::Rolling { epoch: 0, batch: 0, file: RollingFile::Packed }));
        assert_eq!(Node::from_ino(now[1]), Some(Node::Rolling { epoch: 1, batch: 1, file: RollingFile::Packed }));
        // A fresh tree numbers raw/ by its own walk: the same paths, other numbers (what the ledger prevents).
        let (_rt, fresh) = fs(BatchFormat::Tfrecord);
        assert_ne!(resolve(&fresh, "raw/a/y.jpg", 0), inos[2]);
    }

    /// A new worker's `shuffled/` hands out the sample after the last one the old worker handed out.
    #[test]
    fn a_new_worker_hands_out_shuffled_samples_from_where_the_last_one_stopped() {
        let take = |fs: &Fs, n: usize| -> Vec<u64> {
            let dir = resolve(fs, "shuffled/c0", 0);
            let names = fs.dir_entries(dir, 0).unwrap();
            (0..n)
                .map(|i| {
                    let ino = fs.lookup_as(dir, &names[2 + i].2, 1, 50).unwrap().node.ino();
                    fs.opened_as(ino, 1, 50);
                    ino
                })
                .collect()
        };
        let (_rt, reference, _) = class_tree(&[6, 2], (0, 1));
        let all = take(&reference, 5);
        let ledger = Arc::new(crate::ledger::Ledger::create().unwrap());
        let (_rt, mut old, _) = class_tree(&[6, 2], (0, 1));
        old.record_in(ledger.clone());
        assert_eq!(take(&old, 3), all[..3]);
        drop(old);
        let (_rt, mut new, _) = class_tree(&[6, 2], (0, 1));
        new.record_in(ledger);
        assert_eq!(take(&new, 2), all[3..], "the samples after the old worker's, not its first again");
    }

    /// The reference model of [`fs`]'s tree (tfrecord format): every path, `None` for a directory, the
    /// bytes for a file. `.batchfs/stats` changes as it is read, so the model holds only that it exists.
    /// The epoch the next open of each `rolling/` name gets, by (batch, index twin); absent: 0.
    type Next = std::collections::HashMap<(u64, bool), u64>;

    fn model(next: &Next) -> std::collections::BTreeMap<String, Option<Vec<u8>>> {
        let mut m = std::collections::BTreeMap::new();
        for dir in ["", ".batchfs", "raw", "raw/a", "raw/b", "raw/b/c"] {
            m.insert(dir.to_owned(), None);
        }
        m.insert(".batchfs/stats".to_owned(), Some(Vec::new()));
        for p in RAW_FILES {
            m.insert(format!("raw/{p}"), Some(format!("contents of {p}").into_bytes()));
        }
        // Epochs 0 and 1 are listed; 2 is not, and resolves by name all the same.
        for e in 0..3u64 {
            m.insert(epoch_name(e), None);
            for b in 0..3 {
                for f in [BatchFormat::Tfrecord, BatchFormat::TfrecordIdx] {
                    let body = format!("{f} epoch {e} batch {b}").into_bytes();
                    m.insert(format!("{}/{}", epoch_name(e), batch_name(b, f)), Some(body));
                }
            }
        }
        // rolling/: each name at the epoch its next open gets, in the packed layout.
        m.insert("rolling".into(), None);
        for b in 0..3 {
            for (index, f) in [(false, BatchFormat::Tfrecord), (true, BatchFormat::TfrecordIdx)] {
                let e = next.get(&(b, index)).copied().unwrap_or(0);
                m.insert(
                    format!("rolling/{}", batch_name(b, f)),
                    Some(format!("{f} epoch {e} batch {b}").into_bytes()),
                );
            }
        }
        m
    }

    /// The paths the operations pick from: the model's, and names that must not resolve.
    fn paths() -> Vec<String> {
        let mut all: Vec<String> = model(&Next::new()).into_keys().collect();
        all.extend(
            [
                "epoch-2",
                "epoch-00001",
                "batch-000000.tfrecord",
                "epoch-0000/batch-000003.tfrecord",
                "epoch-0000/batch-000000.tar",
                "epoch-0000/batch-0.tfrecord",
                "raw/nope",
                "raw/top.txt/x",
                "raw/a/x.jpg/y",
                "top.txt",
                ".batchfs/other",
                "epoch-0001/batch-000001.tfrecord/x",
                "rolling/batch-000003.tfrecord",
                "rolling/batch-000000.tar",
            ]
            .map(String::from),
        );
        all
    }

    /// Resolves `path` from the root, one lookup per component, as the kernel does.
    fn walk(fs: &Fs, path: &str) -> Result<Attr, i32> {
        let mut at = fs.getattr(ROOT).map_err(|e| e.errno())?;
        for part in path.split('/').filter(|p| !p.is_empty()) {
            at = fs.lookup(at.node.ino(), part, 0).map_err(|e| e.errno())?;
        }
        Ok(at)
    }

    /// What the model says a lookup of `path` returns: its size, or the errno.
    fn model_walk(m: &std::collections::BTreeMap<String, Option<Vec<u8>>>, path: &str) -> Result<u64, i32> {
        let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
        for k in 1..parts.len() {
            if let Some(Some(_)) = m.get(&parts[..k].join("/")) {
                return Err(libc::ENOTDIR);
            }
        }
        match m.get(&parts.join("/")) {
            Some(Some(body)) => Ok(body.len() as u64),
            Some(None) => Ok(0),
            None => Err(libc::ENOENT),
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Lookup(usize),
        Readdir(usize),
        Read { path: usize, offset: u64, size: u32 },
        OpenClose(usize),
        Backing(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let n = paths().len();
        prop_oneof![
            (0..n).prop_map(Op::Lookup),
            (0..n).prop_map(Op::Readdir),
            (0..n, 0u64..40, 0u32..40).prop_map(|(path, offset, size)| Op::Read { path, offset, size }),
            (0..n).prop_map(Op::OpenClose),
            (0..n).prop_map(Op::Backing),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
        /// Reference model (as mountpoint-s3's reftests): random sequences of lookups, listings, reads,
        /// opens with their releases and passthrough opens give what the model says, in any order; each
        /// open of a `rolling/` name moves it to the next epoch.
        #[test]
        fn operations_match_the_reference_model(ops in proptest::collection::vec(op(), 1..40)) {
            let (_rt, fs) = fs(BatchFormat::Tfrecord);
            let mut next = Next::new();
            let all = paths();
            for op in ops {
                let m = model(&next);
                match op {
                    Op::Lookup(i) => {
                        let got = walk(&fs, &all[i]).map(|a| if all[i] == ".batchfs/stats" { 0 } else { a.size });
                        prop_assert_eq!(got, model_walk(&m, &all[i]), "lookup {}", all[i]);
                    }
                    Op::Readdir(i) => {
                        let (path, want) = (&all[i], model_walk(&m, &all[i]));
                        let Ok(attr) = walk(&fs, path) else { continue };
                        prop_assert!(want.is_ok());
                        let names = |e: Vec<(Node, String)>| e.into_iter().map(|(_, n)| n).collect::<Vec<_>>();
                        let got = fs.readdir(attr.node.ino(), 0).map(names);
                        if m.get(path.as_str()).is_some_and(|e| e.is_some()) {
                            prop_assert_eq!(got.map_err(|e| e.errno()), Err(libc::ENOTDIR), "readdir of file {}", path);
                            continue;
                        }
                        let prefix = if path.is_empty() { String::new() } else { format!("{path}/") };
                        let mut children: Vec<String> = m
                            .keys()
                            .filter_map(|k| k.strip_prefix(prefix.as_str()))
                            .filter(|r| !r.is_empty() && !r.contains('/'))
                            .map(String::from)
                            .filter(|name| !path.is_empty() || name != "epoch-0002") // not listed, only resolves
                            .collect();
                        let mut got = got.unwrap();
                        children.sort();
                        got.sort();
                        prop_assert_eq!(got, children, "readdir {}", path);
                    }
                    Op::Read { path, offset, size } => {
                        let Ok(attr) = walk(&fs, &all[path]) else { continue };
                        let got = fs.read(attr.node.ino(), offset, size, 1);
                        match m.get(all[path].as_str()) {
                            // Read by the FUSE adapter from each open's snapshot, never through `Fs::read`.
                            Some(Some(_)) if all[path] == ".batchfs/stats" => prop_assert!(got.is_err()),
                            Some(Some(body)) => {
                                let start = (offset as usize).min(body.len());
                                let end = (offset as usize + size as usize).min(body.len());
                                prop_assert_eq!(&got.unwrap()[..], &body[start..end], "read {}", all[path]);
                            }
                            _ => prop_assert_eq!(got.map_err(|e| e.errno()), Err(libc::EISDIR)),
                        }
                    }
                    Op::OpenClose(i) => {
                        let Ok(attr) = walk(&fs, &all[i]) else { continue };
                        prop_assert_eq!(fs.open(attr.node.ino(), true).map_err(|e| e.errno()), Err(libc::EROFS));
                        prop_assert!(fs.open(attr.node.ino(), false).is_ok());
                        fs.opened(attr.node.ino(), 0);
                        fs.closed(attr.node.ino());
                        // The span is the two listed epochs: 0, 1, 0, ...
                        if let Node::Rolling { epoch, batch, file } = attr.node {
                            next.insert((batch, file == RollingFile::PackedIndex), (epoch + 1) % 2);
                            // The model holds no file open: the kernel would release it at once.
                            fs.released(attr.node.ino(), 0);
                        }
                    }
                    Op::Backing(i) => {
                        let Ok(attr) = walk(&fs, &all[i]) else { continue };
                        let got = fs.backing_file(attr.node.ino(), 1, true).map(|b| b.map(|b| b.file));
                        match m.get(all[i].as_str()) {
                            // A source file of more than one chunk reads through the daemon.
                            Some(Some(body)) if all[i].starts_with("raw/") && body.len() > 16 => {
                                prop_assert!(got.unwrap().is_none(), "no memory file for {}", all[i]);
                            }
                            Some(Some(body)) if all[i] != ".batchfs/stats" => {
                                use std::os::unix::fs::FileExt;
                                let file = got.unwrap().expect("a memory file");
                                let mut bytes = vec![0; body.len()];
                                file.read_exact_at(&mut bytes, 0).unwrap();
                                prop_assert_eq!(&bytes, body, "memory file of {}", all[i]);
                                prop_assert_eq!(file.metadata().unwrap().len(), body.len() as u64);
                            }
                            _ => prop_assert!(got.is_err(), "no memory file for {}", all[i]),
                        }
                    }
                }
            }
        }
    }

    proptest! {
        #[test]
        fn inodes_roundtrip(epoch in 0u64..=MAX_EPOCH, batch in 0u64..MAX_BATCHES, index: bool) {
            let (dir, file) = (Node::RawDir(batch as u32), Node::RawFile(batch as u32));
            let rolling = [RollingFile::Packed, RollingFile::PackedIndex, RollingFile::Indexed]
                .map(|file| Node::Rolling { epoch, batch, file });
            let others = [Node::Epoch(epoch), Node::Batch { epoch, batch, index }, dir, file, Node::RollingDir];
            let twin = Node::RollingIndex { batch };
            for node in others.into_iter().chain(rolling).chain([twin]) {
                prop_assert_eq!(Node::from_ino(node.ino()), Some(node));
            }
        }
    }
}
