//! The filesystem, without FUSE: names, inodes, attributes, directory listings and reads, driven by the
//! FUSE adapter (`fuse.rs`) and directly by tests.
//!
//! ```text
//! /                       epoch-0000 ... epoch-{epochs-1}, .batchfs
//! /epoch-NNNN/            batch-000000.tfrecord (+ batch-000000.tfrecord.idx) | batch-000000.tar
//! /.batchfs/stats         live JSON counters
//! /raw/...                the dataset directory's files as they are on the server (every source)
//! /rolling/               one epoch's names; each open of one serves the next epoch of that file
//! ```
//! Inode numbers encode what they name, so no table grows with the epochs read: the root is 1,
//! `.batchfs` 2, its `stats` 3, `rolling` 4, epoch directory *e* is `2^40 + e`, and batch *b* of epoch
//! *e* is `2^62 + e·2^36 + b·4 + kind` (kind 0: the batch, 1: its DALI index, 2 and 3: the same as seen
//! in `rolling/`, whose layout may differ and whose opens advance its epochs); node *n* of the `raw/` tree
//! (built from the server's file list on first use) is `2^41 + n` for a directory, `2^42 + n` for a
//! file. Any epoch number up to 999,999 resolves by name, listed or not. `stat` and `readdir` use
//! manifests only, never sample data.

use crate::prefetch::{BatchKey, Listing, Prefetcher, ReadError};
use batchfs::encode::BatchFormat;
use batchfs::plan::MAX_EPOCH;
use bytes::Bytes;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;
use thiserror::Error;

pub const ROOT: u64 = 1;
pub const META_DIR: u64 = 2;
pub const STATS_FILE: u64 = 3;
pub const ROLLING_DIR: u64 = 4;
const EPOCH_BASE: u64 = 1 << 40;
const RAW_DIR_BASE: u64 = 1 << 41;
const RAW_FILE_BASE: u64 = 1 << 42;
const BATCH_BASE: u64 = 1 << 62;

/// The name of the statistics directory.
pub const META_NAME: &str = ".batchfs";
/// The name of the source-file tree.
pub const RAW_NAME: &str = "raw";
/// Entries of a `raw/` directory one `readdir` call returns at most.
pub const READDIR_BATCH: usize = 4096;

/// The name of the rolling epoch view.
pub const ROLLING_NAME: &str = "rolling";

/// A filesystem error; the FUSE edge maps each variant to one errno.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("not a directory")]
    NotADirectory,
    #[error("is a directory")]
    IsADirectory,
    #[error("read-only filesystem")]
    ReadOnly,
    #[error("{0}")]
    Io(ReadError),
}

impl FsError {
    /// The errno returned to the caller.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::NotADirectory => libc::ENOTDIR,
            FsError::IsADirectory => libc::EISDIR,
            FsError::ReadOnly => libc::EROFS,
            FsError::Io(_) => libc::EIO,
        }
    }
}

impl From<ReadError> for FsError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::NotFound(_) => FsError::NotFound,
            e => FsError::Io(e),
        }
    }
}

/// What an inode is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    Root,
    MetaDir,
    Stats,
    Epoch(u64),
    /// A batch file; `index` for the `.tfrecord.idx` twin; `rolling` as seen in `rolling/`.
    Batch {
        epoch: u64,
        batch: u64,
        index: bool,
        rolling: bool,
    },
    /// `rolling/`.
    RollingDir,
    /// A directory of the `raw/` tree (node 0 is `raw` itself).
    RawDir(u32),
    /// A source file in the `raw/` tree.
    RawFile(u32),
}

impl Node {
    pub fn ino(self) -> u64 {
        match self {
            Node::Root => ROOT,
            Node::MetaDir => META_DIR,
            Node::Stats => STATS_FILE,
            Node::Epoch(e) => EPOCH_BASE + e,
            Node::Batch { epoch, batch, index, rolling } => {
                BATCH_BASE | epoch << 36 | batch << 2 | u64::from(rolling) << 1 | u64::from(index)
            }
            Node::RollingDir => ROLLING_DIR,
            Node::RawDir(n) => RAW_DIR_BASE + u64::from(n),
            Node::RawFile(n) => RAW_FILE_BASE + u64::from(n),
        }
    }

    pub fn from_ino(ino: u64) -> Option<Node> {
        match ino {
            ROOT => Some(Node::Root),
            META_DIR => Some(Node::MetaDir),
            STATS_FILE => Some(Node::Stats),
            ROLLING_DIR => Some(Node::RollingDir),
            i if i >= BATCH_BASE => {
                let rest = i - BATCH_BASE;
                let (index, rolling) = (rest & 1 == 1, rest & 2 == 2);
                Some(Node::Batch { epoch: rest >> 36, batch: (rest >> 2) & ((1 << 34) - 1), index, rolling })
            }
            i if (EPOCH_BASE..=EPOCH_BASE + MAX_EPOCH).contains(&i) => Some(Node::Epoch(i - EPOCH_BASE)),
            i if (RAW_DIR_BASE..RAW_DIR_BASE + (1 << 32)).contains(&i) => Some(Node::RawDir((i - RAW_DIR_BASE) as u32)),
            i if (RAW_FILE_BASE..RAW_FILE_BASE + (1 << 32)).contains(&i) => {
                Some(Node::RawFile((i - RAW_FILE_BASE) as u32))
            }
            _ => None,
        }
    }

    pub fn is_dir(self) -> bool {
        matches!(self, Node::Root | Node::MetaDir | Node::Epoch(_) | Node::RawDir(_) | Node::RollingDir)
    }
}

/// Name of epoch directory `e`.
pub fn epoch_name(e: u64) -> String {
    format!("epoch-{e:04}")
}

/// Name of batch file `batch` in `format` (`BatchFormat::TfrecordIdx` for the `.idx` twin).
pub fn batch_name(batch: u64, format: BatchFormat) -> String {
    format!("batch-{batch:06}.{}", format.extension())
}

fn parse_epoch(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("epoch-")?;
    let e: u64 = digits.parse().ok()?;
    (digits.bytes().all(|b| b.is_ascii_digit()) && epoch_name(e) == name && e <= MAX_EPOCH).then_some(e)
}

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
    /// The format of TFRecord batches in `rolling/`: `tfrecord` (packed) or `tfrecord.slots`.
    pub rolling: BatchFormat,
    /// The epoch the first open of each `rolling/` file serves.
    pub first_epoch: u64,
}

/// One node of the `raw/` tree.
struct RawNode {
    parent: u32,
    kind: RawKind,
}

enum RawKind {
    /// A directory: its path in the dataset, and its children sorted by name once it is listed.
    Dir { path: String, children: Option<Vec<(String, u32)>> },
    /// A file: its directory's id ([`Prefetcher::list_dir`]) and its position in that list.
    File { dir: u32, file: u64 },
}

/// The `raw/` tree, grown one directory at a time, when a lookup or a listing first looks into it: a
/// tree of a million files costs nothing until it is walked, and what is walked costs per directory.
struct RawTree {
    nodes: Vec<RawNode>,
}

impl RawTree {
    fn new() -> Self {
        RawTree { nodes: vec![RawNode { parent: 0, kind: RawKind::Dir { path: String::new(), children: None } }] }
    }

    fn node(&self, n: u32) -> Node {
        match self.nodes[n as usize].kind {
            RawKind::File { .. } => Node::RawFile(n),
            RawKind::Dir { .. } => Node::RawDir(n),
        }
    }
}

/// What a file reads: a batch, or a file of `raw/` (by its directory's id and its position there).
enum Source {
    Batch(BatchKey),
    Raw { dir: u32, file: u64 },
}

/// The filesystem.
pub struct Fs {
    prefetcher: Arc<Prefetcher>,
    pub options: FsOptions,
    raw: Mutex<RawTree>,
    /// The epoch the next open of each `rolling/` file serves, by (batch, index twin); absent:
    /// `first_epoch`. At most one entry per name of an epoch.
    rolling: Mutex<std::collections::HashMap<(u64, bool), u64>>,
}

impl Fs {
    pub fn new(prefetcher: Arc<Prefetcher>, options: FsOptions) -> Self {
        Fs { prefetcher, options, raw: Mutex::new(RawTree::new()), rolling: Mutex::new(Default::default()) }
    }

    /// The epoch the next open of `rolling/` file `(batch, index)` serves.
    fn rolling_epoch(&self, batch: u64, index: bool) -> u64 {
        let next = self.rolling.lock().expect("rolling");
        next.get(&(batch, index)).copied().unwrap_or(self.options.first_epoch)
    }

    /// Lists directory node `n` of `raw/` from the server (every page) if it is not listed yet, without
    /// holding the tree while it waits.
    fn raw_listed(&self, n: u32) -> Result<(), FsError> {
        if !self.options.raw {
            return Err(FsError::NotFound);
        }
        let path = {
            let tree = self.raw.lock().expect("raw tree");
            match &tree.nodes.get(n as usize).ok_or(FsError::NotFound)?.kind {
                RawKind::Dir { children: Some(_), .. } => return Ok(()),
                RawKind::Dir { path, children: None } => path.clone(),
                RawKind::File { .. } => return Err(FsError::NotADirectory),
            }
        };
        let (dir, list) = self.prefetcher.list_dir(&path)?;
        let mut tree = self.raw.lock().expect("raw tree");
        // Another thread may have listed it meanwhile: its nodes stand.
        if let RawKind::Dir { children: Some(_), .. } = &tree.nodes[n as usize].kind {
            return Ok(());
        }
        let prefix = if path.is_empty() { String::new() } else { format!("{path}/") };
        let mut children = Vec::with_capacity(list.dirs.len() + list.files.len());
        for sub in &list.dirs {
            let kind = RawKind::Dir { path: format!("{prefix}{sub}"), children: None };
            children.push((sub.clone(), tree.nodes.len() as u32));
            tree.nodes.push(RawNode { parent: n, kind });
        }
        for (file, entry) in list.files.iter().enumerate() {
            let name = entry.path.rsplit('/').next().unwrap_or_default();
            children.push((name.to_owned(), tree.nodes.len() as u32));
            tree.nodes.push(RawNode { parent: n, kind: RawKind::File { dir, file: file as u64 } });
        }
        children.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if let RawKind::Dir { children: slot, .. } = &mut tree.nodes[n as usize].kind {
            *slot = Some(children);
        }
        Ok(())
    }

    /// Child `name` of directory node `n` of `raw/` (a binary search, whatever the directory's size).
    fn raw_lookup(&self, n: u32, name: &str) -> Result<Node, FsError> {
        self.raw_listed(n)?;
        let tree = self.raw.lock().expect("raw tree");
        let RawKind::Dir { children: Some(children), .. } = &tree.nodes[n as usize].kind else {
            return Err(FsError::NotFound);
        };
        let at = children.binary_search_by(|(child, _)| child.as_str().cmp(name)).map_err(|_| FsError::NotFound)?;
        Ok(tree.node(children[at].1))
    }

    /// At most `max` entries of directory node `n` of `raw/` from position `from`, by name.
    fn raw_entries(&self, n: u32, from: usize, max: usize) -> Result<Vec<(String, Node)>, FsError> {
        self.raw_listed(n)?;
        let tree = self.raw.lock().expect("raw tree");
        let RawKind::Dir { children: Some(children), .. } = &tree.nodes[n as usize].kind else {
            return Err(FsError::NotFound);
        };
        let slice = children.get(from..).unwrap_or_default();
        Ok(slice.iter().take(max).map(|(name, c)| (name.clone(), tree.node(*c))).collect())
    }

    /// Directory `dir` and position `file` of node `n` of `raw/`, if it is a file.
    fn raw_file(&self, n: u32) -> Result<(u32, u64), FsError> {
        let tree = self.raw.lock().expect("raw tree");
        match tree.nodes.get(n as usize).map(|node| &node.kind) {
            Some(&RawKind::File { dir, file }) => Ok((dir, file)),
            _ => Err(FsError::NotFound),
        }
    }

    /// The parent directory of directory `ino` (the root is its own).
    pub fn parent(&self, ino: u64) -> u64 {
        match Node::from_ino(ino) {
            Some(Node::RawDir(0)) | Some(Node::Epoch(_)) | Some(Node::MetaDir) | Some(Node::RollingDir) => ROOT,
            Some(Node::RawDir(n)) => {
                let tree = self.raw.lock().expect("raw tree");
                tree.nodes.get(n as usize).map_or(ROOT, |node| Node::RawDir(node.parent).ino())
            }
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

    /// The format of a batch file (`rolling`: as `rolling/` shows it).
    fn batch_format(&self, index: bool, rolling: bool) -> BatchFormat {
        let format = if rolling && self.options.format == BatchFormat::Tfrecord {
            self.options.rolling
        } else {
            self.options.format
        };
        match format.index() {
            Some(idx) if index => idx,
            _ => format,
        }
    }

    fn parse_batch(&self, name: &str) -> Option<(u64, bool)> {
        let rest = name.strip_prefix("batch-")?;
        let (digits, ext) = rest.split_once('.')?;
        let batch: u64 = digits.parse().ok()?;
        if !digits.bytes().all(|b| b.is_ascii_digit()) || format!("{batch:06}") != digits || batch >= 1 << 34 {
            return None;
        }
        match ext {
            e if e == self.options.format.as_str() => Some((batch, false)),
            "tfrecord.idx" if self.options.format == BatchFormat::Tfrecord => Some((batch, true)),
            _ => None,
        }
    }

    /// Current statistics as JSON.
    pub fn stats_json(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec_pretty(&self.prefetcher.stats.snapshot()).expect("stats serialize");
        out.push(b'\n');
        out
    }

    /// Resolves `name` in directory `parent`.
    pub fn lookup(&self, parent: u64, name: &str) -> Result<Attr, FsError> {
        let node = match Node::from_ino(parent).ok_or(FsError::NotFound)? {
            Node::Root if name == META_NAME => Node::MetaDir,
            Node::Root if name == RAW_NAME && self.options.raw => Node::RawDir(0),
            Node::Root if name == ROLLING_NAME => Node::RollingDir,
            Node::Root => Node::Epoch(parse_epoch(name).ok_or(FsError::NotFound)?),
            Node::MetaDir if name == "stats" => Node::Stats,
            Node::Epoch(epoch) => {
                let (batch, index) = self.parse_batch(name).ok_or(FsError::NotFound)?;
                Node::Batch { epoch, batch, index, rolling: false }
            }
            // The file the next open gets: the kernel asks again at every open (no entry is cached).
            Node::RollingDir => {
                let (batch, index) = self.parse_batch(name).ok_or(FsError::NotFound)?;
                Node::Batch { epoch: self.rolling_epoch(batch, index), batch, index, rolling: true }
            }
            Node::RawDir(n) => self.raw_lookup(n, name)?,
            Node::MetaDir => return Err(FsError::NotFound),
            Node::Stats | Node::Batch { .. } | Node::RawFile(_) => return Err(FsError::NotADirectory),
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
            Node::Batch { epoch, batch, index, rolling } => {
                let manifest = self.prefetcher.manifest(epoch, self.batch_format(index, rolling))?;
                manifest.batches.get(batch as usize).ok_or(FsError::NotFound)?.bytes
            }
            Node::RawFile(n) => {
                let (dir, file) = self.raw_file(n)?;
                self.prefetcher.file_size(dir, file)?
            }
            Node::RawDir(n) => {
                let tree = self.raw.lock().expect("raw tree");
                if !self.options.raw
                    || !matches!(tree.nodes.get(n as usize), Some(RawNode { kind: RawKind::Dir { .. }, .. }))
                {
                    return Err(FsError::NotFound);
                }
                0
            }
            _ => 0,
        };
        Ok(Attr { node, size })
    }

    /// The entries of directory `ino` (without `.` and `..`).
    pub fn readdir(&self, ino: u64) -> Result<Vec<(Node, String)>, FsError> {
        match Node::from_ino(ino).ok_or(FsError::NotFound)? {
            Node::Root => {
                let mut out = vec![(Node::MetaDir, META_NAME.to_owned())];
                if self.options.raw {
                    out.push((Node::RawDir(0), RAW_NAME.to_owned()));
                }
                out.push((Node::RollingDir, ROLLING_NAME.to_owned()));
                out.extend((0..self.options.epochs.min(MAX_EPOCH + 1)).map(|e| (Node::Epoch(e), epoch_name(e))));
                Ok(out)
            }
            Node::MetaDir => Ok(vec![(Node::Stats, "stats".to_owned())]),
            Node::Epoch(epoch) => self.batch_entries(epoch, |_, _| epoch, false),
            // One epoch's names (every epoch has as many batches), each at the epoch its next open gets.
            Node::RollingDir => {
                let next = self.rolling.lock().expect("rolling").clone();
                let first = self.options.first_epoch;
                self.batch_entries(first, |b, index| next.get(&(b, index)).copied().unwrap_or(first), true)
            }
            Node::RawDir(n) => {
                Ok(self.raw_entries(n, 0, usize::MAX)?.into_iter().map(|(name, node)| (node, name)).collect())
            }
            Node::Stats | Node::Batch { .. } | Node::RawFile(_) => Err(FsError::NotADirectory),
        }
    }

    /// The batch files of epoch `listed` (and their index twins), each named in the epoch `epoch_of`
    /// gives for (batch, index twin).
    fn batch_entries(
        &self,
        listed: u64,
        epoch_of: impl Fn(u64, bool) -> u64,
        rolling: bool,
    ) -> Result<Vec<(Node, String)>, FsError> {
        let manifest = self.prefetcher.manifest(listed, self.batch_format(false, rolling))?;
        let with_index = self.options.format.index().is_some();
        let mut out = Vec::with_capacity(manifest.batches.len() * 2);
        for b in 0..manifest.batches.len() as u64 {
            for index in [false, true].into_iter().filter(|&i| !i || with_index) {
                let node = Node::Batch { epoch: epoch_of(b, index), batch: b, index, rolling };
                out.push((node, batch_name(b, self.batch_format(index, rolling))));
            }
        }
        Ok(out)
    }

    /// Every entry of directory `ino` as `readdir` returns it: `.`, `..`, then [`Fs::readdir`]'s, each as
    /// (inode, is a directory, name).
    pub fn dir_entries(&self, ino: u64) -> Result<Vec<(u64, bool, String)>, FsError> {
        self.dir_entries_from(ino, 0)
    }

    /// [`Fs::dir_entries`] from position `offset` on: all of them, except in a directory of `raw/`, where
    /// a call gives at most [`READDIR_BATCH`] (the kernel asks again from where it got to), so listing a
    /// directory of a million files costs each entry once, not the whole directory per call.
    pub fn dir_entries_from(&self, ino: u64, offset: usize) -> Result<Vec<(u64, bool, String)>, FsError> {
        let dots = [(ino, true, ".".to_owned()), (self.parent(ino), true, "..".to_owned())];
        let entries = match Node::from_ino(ino) {
            Some(Node::RawDir(n)) => self.raw_entries(n, offset.saturating_sub(2), READDIR_BATCH)?,
            _ => {
                self.readdir(ino)?.into_iter().map(|(node, name)| (name, node)).skip(offset.saturating_sub(2)).collect()
            }
        };
        let mut out: Vec<(u64, bool, String)> = dots.into_iter().skip(offset).collect();
        out.extend(entries.into_iter().map(|(name, n)| (n.ino(), n.is_dir(), name)));
        Ok(out)
    }

    /// Checks that `ino` can be opened for reading. Opening a file of `rolling/` moves that name on: its
    /// next lookup (the next open's) is the following epoch's file.
    pub fn open(&self, ino: u64, write: bool) -> Result<Node, FsError> {
        let node = Node::from_ino(ino).ok_or(FsError::NotFound)?;
        if write {
            return Err(FsError::ReadOnly);
        }
        if let Node::Batch { epoch, batch, index, rolling: true } = node {
            let mut next = self.rolling.lock().expect("rolling");
            let at = next.entry((batch, index)).or_insert(self.options.first_epoch);
            // Two opens that looked the name up together both get its epoch; the name moves on once.
            *at = (*at).max(epoch + 1).min(MAX_EPOCH);
        }
        Ok(node)
    }

    /// What file `ino` reads.
    fn source(&self, ino: u64) -> Result<Source, FsError> {
        match Node::from_ino(ino).ok_or(FsError::NotFound)? {
            Node::Batch { epoch, batch, index, rolling } => {
                Ok(Source::Batch(BatchKey::batch(epoch, batch, self.batch_format(index, rolling))))
            }
            Node::RawFile(n) => {
                let (dir, file) = self.raw_file(n)?;
                Ok(Source::Raw { dir, file })
            }
            Node::Stats => Err(FsError::NotFound),
            _ => Err(FsError::IsADirectory),
        }
    }

    /// Reads `size` bytes at `offset` of file `ino` for the reading process `owner`.
    pub fn read(&self, ino: u64, offset: u64, size: u32, owner: u32) -> Result<Bytes, FsError> {
        if Node::from_ino(ino) == Some(Node::Stats) {
            let json = self.stats_json();
            let start = (offset as usize).min(json.len());
            let end = (start + size as usize).min(json.len());
            return Ok(Bytes::copy_from_slice(&json[start..end]));
        }
        Ok(match self.source(ino)? {
            Source::Batch(key) => self.prefetcher.read(key, offset, size, owner)?,
            Source::Raw { dir, file } => self.prefetcher.read_file(dir, file, offset, size, owner)?,
        })
    }

    /// The verified contents of file `ino` as a sealed memory file, for the kernel to serve (FUSE
    /// passthrough); waits for the file like a read by `owner` does. `None` for a source file of more
    /// than one chunk: it is read through the daemon, chunk by chunk, never held whole.
    pub fn backing_file(&self, ino: u64, owner: u32) -> Result<Option<Arc<std::fs::File>>, FsError> {
        let key = match self.source(ino)? {
            Source::Batch(key) => key,
            Source::Raw { dir, file } => {
                let chunks = self.prefetcher.file_chunks(dir, file)?;
                if chunks.end - chunks.start != 1 {
                    return Ok(None);
                }
                BatchKey { listing: Listing::Raw { dir }, index: chunks.start }
            }
        };
        Ok(Some(self.prefetcher.backing_file(key, owner)?))
    }

    /// The last handle of file `ino` was closed.
    pub fn closed(&self, ino: u64) {
        match self.source(ino) {
            Ok(Source::Batch(key)) => self.prefetcher.closed(key),
            Ok(Source::Raw { dir, file }) => {
                for index in self.prefetcher.file_chunks(dir, file).unwrap_or_default() {
                    self.prefetcher.closed(BatchKey { listing: Listing::Raw { dir }, index });
                }
            }
            Err(_) => {}
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
            rolling: BatchFormat::TfrecordSlots,
            first_epoch: 0,
        }
    }

    #[test]
    fn tree_and_reads() {
        let (_rt, fs) = fs(BatchFormat::Tfrecord);
        let names: Vec<String> = fs.readdir(ROOT).unwrap().into_iter().map(|(_, n)| n).collect();
        assert_eq!(names, [".batchfs", "raw", "rolling", "epoch-0000", "epoch-0001"]);
        let e7 = fs.lookup(ROOT, "epoch-0007").unwrap();
        assert_eq!(e7.node, Node::Epoch(7), "unlisted epochs resolve by name");
        let listing: Vec<String> = fs.readdir(e7.node.ino()).unwrap().into_iter().map(|(_, n)| n).collect();
        assert_eq!(listing[..2], ["batch-000000.tfrecord", "batch-000000.tfrecord.idx"]);
        let f = fs.lookup(e7.node.ino(), "batch-000002.tfrecord").unwrap();
        let want = "tfrecord epoch 7 batch 2";
        assert_eq!(f.size, want.len() as u64);
        assert_eq!(fs.read(f.node.ino(), 0, 100, 1).unwrap(), want.as_bytes());
        let idx = fs.lookup(e7.node.ino(), "batch-000002.tfrecord.idx").unwrap();
        assert_eq!(fs.read(idx.node.ino(), 0, 100, 1).unwrap(), "tfrecord.idx epoch 7 batch 2".as_bytes());
        let stats = fs.lookup(META_DIR, "stats").unwrap();
        let json: serde_json::Value =
            serde_json::from_slice(&fs.read(stats.node.ino(), 0, 1 << 16, 1).unwrap()).unwrap();
        assert_eq!(json["reads"], 2);
    }

    #[test]
    fn each_open_of_a_rolling_name_serves_the_next_epoch_of_that_file() {
        let (_rt, mut fs) = fs(BatchFormat::Tfrecord);
        fs.options.first_epoch = 5;
        let rolling = fs.lookup(ROOT, "rolling").unwrap().node;
        assert_eq!(rolling, Node::RollingDir);
        let names: Vec<String> = fs.readdir(rolling.ino()).unwrap().into_iter().map(|(_, n)| n).collect();
        assert_eq!(names[..2], ["batch-000000.tfrecord", "batch-000000.tfrecord.idx"]);
        assert_eq!(names.len(), 6);
        let open = |name: &str| {
            let attr = fs.lookup(rolling.ino(), name).unwrap();
            fs.open(attr.node.ino(), false).unwrap();
            let body = fs.read(attr.node.ino(), 0, 100, 1).unwrap();
            fs.closed(attr.node.ino());
            assert_eq!(attr.size, body.len() as u64);
            String::from_utf8(body.to_vec()).unwrap()
        };
        // Looking a name up (stat, ls) moves nothing; each open does, per name.
        fs.lookup(rolling.ino(), "batch-000001.tfrecord").unwrap();
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord.slots epoch 5 batch 1");
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord.slots epoch 6 batch 1");
        assert_eq!(open("batch-000002.tfrecord"), "tfrecord.slots epoch 5 batch 2");
        assert_eq!(open("batch-000001.tfrecord.idx"), "tfrecord.slots.idx epoch 5 batch 1");
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord.slots epoch 7 batch 1");
        // readdir names each file at the epoch its next open gets.
        let listed = fs.readdir(rolling.ino()).unwrap();
        let epoch_of = |name: &str| match listed.iter().find(|(_, n)| n == name).unwrap().0 {
            Node::Batch { epoch, rolling: true, .. } => epoch,
            other => panic!("{other:?}"),
        };
        assert_eq!((epoch_of("batch-000001.tfrecord"), epoch_of("batch-000000.tfrecord")), (8, 5));
        // Two opens of one looked-up file (two readers that resolved it together) share its epoch.
        let attr = fs.lookup(rolling.ino(), "batch-000000.tfrecord").unwrap();
        fs.open(attr.node.ino(), false).unwrap();
        fs.open(attr.node.ino(), false).unwrap();
        assert_eq!(open("batch-000000.tfrecord"), "tfrecord.slots epoch 6 batch 0");
        assert_eq!(fs.lookup(rolling.ino(), "batch-000003.tfrecord").unwrap_err().errno(), libc::ENOENT);
        assert_eq!(fs.parent(rolling.ino()), ROOT);
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
        let raw = fs.lookup(ROOT, "raw").unwrap().node;
        assert!(client.listed.lock().unwrap().is_empty(), "nothing is listed before it is looked into");
        let big = fs.lookup(raw.ino(), "big").unwrap().node;
        let f = fs.lookup(big.ino(), "f04321").unwrap();
        assert_eq!(fs.read(f.node.ino(), 0, 10, 1).unwrap(), Bytes::from_static(b"x"));
        let listed: Vec<String> = client.listed.lock().unwrap().iter().map(|(d, _)| d.clone()).collect();
        assert!(listed.iter().all(|d| d.is_empty() || d == "big"), "{listed:?}");
        assert_eq!(listed.iter().filter(|d| *d == "big").count(), 4, "four pages of 3,000: {listed:?}");
        // readdir from each offset the kernel asks for: every entry once, in calls of at most a batch.
        let mut names = Vec::new();
        let mut offset = 0;
        loop {
            let got = fs.dir_entries_from(big.ino(), offset).unwrap();
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

    #[test]
    fn raw_tree_shows_the_source_files() {
        let (_rt, fs) = fs(BatchFormat::Tar);
        let raw = fs.lookup(ROOT, "raw").unwrap().node;
        let top: Vec<String> = fs.readdir(raw.ino()).unwrap().into_iter().map(|(_, n)| n).collect();
        assert_eq!(top, ["a", "b", "s", "top.txt"]);
        let b = fs.lookup(raw.ino(), "b").unwrap().node;
        let c = fs.lookup(b.ino(), "c").unwrap().node;
        assert!(c.is_dir());
        // `..` of a directory deep in raw/ is its parent (it once was the directory itself).
        let dots = |ino| fs.dir_entries(ino).unwrap()[..2].to_vec();
        assert_eq!(dots(c.ino()), [(c.ino(), true, ".".to_owned()), (b.ino(), true, "..".to_owned())]);
        assert_eq!(dots(b.ino())[1].0, raw.ino());
        assert_eq!(dots(raw.ino())[1].0, ROOT);
        assert_eq!(dots(ROOT)[1].0, ROOT);
        assert_eq!(dots(Node::Epoch(1).ino())[1].0, ROOT);
        let listed: Vec<String> = fs.dir_entries(c.ino()).unwrap().into_iter().map(|e| e.2).collect();
        assert_eq!(listed, [".", "..", "z.jpg"]);
        let z = fs.lookup(c.ino(), "z.jpg").unwrap();
        assert_eq!(z.size, "contents of b/c/z.jpg".len() as u64);
        assert_eq!(fs.read(z.node.ino(), 0, 1000, 1).unwrap(), "contents of b/c/z.jpg".as_bytes());
        assert_eq!(fs.read(z.node.ino(), 9, 4, 1).unwrap(), "of b".as_bytes());
        // Across the boundary of its two 16-byte chunks, and from the second alone.
        assert_eq!(fs.read(z.node.ino(), 12, 8, 1).unwrap(), "b/c/z.jp".as_bytes());
        assert_eq!(fs.read(z.node.ino(), 17, 100, 1).unwrap(), ".jpg".as_bytes());
        assert_eq!(fs.read(z.node.ino(), 21, 100, 1).unwrap(), "".as_bytes());
        assert_eq!(fs.lookup(raw.ino(), "nope").unwrap_err().errno(), libc::ENOENT);
        assert_eq!(fs.lookup(z.node.ino(), "x").unwrap_err().errno(), libc::ENOTDIR);
    }

    #[test]
    fn errors_map_to_errnos() {
        let (_rt, fs) = fs(BatchFormat::Tar);
        let e0 = Node::Epoch(0).ino();
        for missing in ["batch-000003.tar", "batch-000000.tfrecord", "batch-0.tar", "batch-0000001.tar", "x"] {
            assert_eq!(fs.lookup(e0, missing).unwrap_err().errno(), libc::ENOENT, "{missing}");
        }
        for bad in ["epoch-1", "epoch-00001", "epoch-1000000", "epoch-+001", "nothing"] {
            assert_eq!(fs.lookup(ROOT, bad).unwrap_err().errno(), libc::ENOENT, "{bad}");
        }
        let file = fs.lookup(e0, "batch-000000.tar").unwrap().node.ino();
        assert_eq!(fs.lookup(file, "x").unwrap_err().errno(), libc::ENOTDIR);
        assert_eq!(fs.open(file, true).unwrap_err().errno(), libc::EROFS);
        assert_eq!(fs.read(e0, 0, 10, 1).unwrap_err().errno(), libc::EISDIR);
        assert_eq!(fs.getattr(12345).unwrap_err().errno(), libc::ENOENT);
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
        // rolling/: each name at the epoch its next open gets, in the slots layout.
        m.insert("rolling".into(), None);
        for b in 0..3 {
            for (index, f) in [(false, BatchFormat::TfrecordSlots), (true, BatchFormat::TfrecordSlotsIdx)] {
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
            at = fs.lookup(at.node.ino(), part).map_err(|e| e.errno())?;
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
                        let got = fs.readdir(attr.node.ino()).map(names);
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
                            Some(Some(_)) if all[path] == ".batchfs/stats" => prop_assert!(got.is_ok()),
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
                        fs.closed(attr.node.ino());
                        if let Node::Batch { epoch, batch, index, rolling: true } = attr.node {
                            next.insert((batch, index), epoch + 1);
                        }
                    }
                    Op::Backing(i) => {
                        let Ok(attr) = walk(&fs, &all[i]) else { continue };
                        let got = fs.backing_file(attr.node.ino(), 1);
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
        fn inodes_roundtrip(epoch in 0u64..=MAX_EPOCH, batch in 0u64..(1 << 34), index: bool) {
            let (dir, file) = (Node::RawDir(batch as u32), Node::RawFile(batch as u32));
            let batches = [false, true].map(|rolling| Node::Batch { epoch, batch, index, rolling });
            for node in [Node::Epoch(epoch), batches[0], batches[1], dir, file, Node::RollingDir] {
                prop_assert_eq!(Node::from_ino(node.ino()), Some(node));
            }
        }
    }
}
