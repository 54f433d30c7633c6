//! `rolling/` (docs/SEMANTICS.md, "rolling/"): one epoch's batch names, each open of a name serving the
//! next epoch of that file, for loaders that read the same paths every epoch. Its state (each name's
//! counters, each reader's layout, the files held open) is `rolling/state.rs`; the names and batch inode
//! numbers are the epoch folders' (`views/epochs.rs`).

use super::epochs::{batch_ino, batch_of, BatchNames, MAX_BATCHES};
use super::{Attr, Entry, Keep, View, Who};
use crate::fs::{Backing, FsError, FsOptions, ROOT};
use crate::ledger::Ledger;
use crate::prefetch::{ObjectKey, Prefetcher, ReadError};
use batchfs::encode::BatchFormat;
use bytes::Bytes;
use std::sync::Arc;

pub mod placed;
mod state;
use state::{Layout, RollingState};

/// The name of the rolling epoch view.
pub const ROLLING_NAME: &str = "rolling";
/// `rolling/`.
pub const ROLLING_DIR: u64 = 4;
const TWIN_BASE: u64 = 1 << 43;

/// What a file of `rolling/` is, in the epoch it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RollingFile {
    /// The epoch's batch as its epoch directory has it.
    Packed,
    /// Its DALI index.
    PackedIndex,
    /// The batch's records at the fixed offsets of the indexed layout.
    Indexed,
}

/// What an inode of this view is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    /// `rolling/`.
    Dir,
    /// A file of `rolling/` as it serves epoch `epoch`.
    File { epoch: u64, batch: u64, file: RollingFile },
    /// The `.tfrecord.idx` twin of name `batch` in the indexed layout: one file for every epoch.
    Twin { batch: u64 },
}

impl Node {
    pub fn ino(self) -> u64 {
        match self {
            Node::Dir => ROLLING_DIR,
            Node::Twin { batch } => TWIN_BASE + batch,
            Node::File { epoch, batch, file } => batch_ino(
                epoch,
                batch,
                match file {
                    RollingFile::Packed => 2,
                    RollingFile::PackedIndex => 3,
                    RollingFile::Indexed => 4,
                },
            ),
        }
    }

    pub fn from_ino(ino: u64) -> Option<Node> {
        match ino {
            ROLLING_DIR => Some(Node::Dir),
            i if (TWIN_BASE..TWIN_BASE + MAX_BATCHES).contains(&i) => Some(Node::Twin { batch: i - TWIN_BASE }),
            i => {
                let (epoch, batch, kind) = batch_of(i)?;
                let file = match kind {
                    2 => RollingFile::Packed,
                    3 => RollingFile::PackedIndex,
                    4 => RollingFile::Indexed,
                    _ => return None,
                };
                Some(Node::File { epoch, batch, file })
            }
        }
    }
}

/// The view.
pub struct Rolling {
    prefetcher: Arc<Prefetcher>,
    names: BatchNames,
    state: RollingState,
}

impl Rolling {
    pub fn new(prefetcher: Arc<Prefetcher>, options: &FsOptions) -> Self {
        // At most what a slot table covers (as the prefetcher's span): it starts over after that.
        let span = options.epochs.min(batchfs::rolling::MAX_SPAN);
        let state = RollingState::new(options.rolling, options.first_epoch, span);
        Rolling { prefetcher, names: BatchNames(options.format), state }
    }

    fn node(&self, ino: u64) -> Result<Node, FsError> {
        Node::from_ino(ino).ok_or(FsError::NotFound)
    }

    /// The layout `owner` reads `rolling/` in: the indexed one holds TFRecord batches only.
    fn layout(&self, owner: u32, twin: bool) -> Layout {
        if self.names.0 != BatchFormat::Tfrecord {
            return Layout::Packed;
        }
        if twin {
            self.state.twin_layout()
        } else {
            self.state.layout(owner)
        }
    }

    /// The file named `(batch, twin)` as `owner` sees it now: the one its next open gets, or, in the
    /// packed layout, the one it has open.
    fn named(&self, batch: u64, twin: bool, owner: u32) -> Node {
        let file = match (self.layout(owner, twin), twin) {
            (Layout::Packed, false) => RollingFile::Packed,
            (Layout::Packed, true) => RollingFile::PackedIndex,
            (Layout::Indexed, false) => RollingFile::Indexed,
            (Layout::Indexed, true) => return Node::Twin { batch },
        };
        let next = self.state.epoch_of(batch, file);
        let held = (file != RollingFile::Indexed).then(|| self.state.held(batch, file, owner)).flatten();
        Node::File { epoch: held.unwrap_or(next), batch, file }
    }

    /// The indexed layout's twin of name `batch` (the same for every epoch).
    fn twin(&self, batch: u64) -> Result<Bytes, FsError> {
        Ok(Bytes::from(self.prefetcher.file_layout(batch)?.dali_index()))
    }

    /// What file `(epoch, batch, file)` reads.
    fn key(&self, epoch: u64, batch: u64, file: RollingFile) -> ObjectKey {
        match file {
            RollingFile::Packed => self.names.key(epoch, batch, false),
            RollingFile::PackedIndex => self.names.key(epoch, batch, true),
            RollingFile::Indexed => placed::key(epoch, batch),
        }
    }
}

impl View for Rolling {
    fn owns(&self, ino: u64) -> bool {
        Node::from_ino(ino).is_some()
    }

    fn in_root(&self) -> Vec<Entry> {
        vec![Entry::new(ROLLING_DIR, true, ROLLING_NAME)]
    }

    fn root_lookup(&self, name: &str) -> Option<u64> {
        (name == ROLLING_NAME).then_some(ROLLING_DIR)
    }

    fn parent(&self, _dir: u64) -> u64 {
        ROOT
    }

    /// The file the next open gets: the kernel asks again at every open (no entry is kept).
    fn lookup(&self, dir: u64, name: &str, who: Who) -> Result<u64, FsError> {
        match self.node(dir)? {
            Node::Dir => {
                let (batch, index) = self.names.parse(name).ok_or(FsError::NotFound)?;
                Ok(self.named(batch, index, who.owner).ino())
            }
            Node::File { .. } | Node::Twin { .. } => Err(FsError::NotADirectory),
        }
    }

    fn attr(&self, ino: u64) -> Result<Attr, FsError> {
        let size = match self.node(ino)? {
            Node::Dir => return Ok(Attr::dir(ino)),
            Node::File { epoch, batch, file: file @ (RollingFile::Packed | RollingFile::PackedIndex) } => {
                self.names.size(&self.prefetcher, epoch, batch, file == RollingFile::PackedIndex)?
            }
            Node::File { epoch, batch, file: RollingFile::Indexed } => {
                // The batch must exist in its epoch (the manifest says), and its file is the layout's.
                let manifest = self.prefetcher.manifest(epoch, BatchFormat::Tfrecord)?;
                manifest.batches.get(batch as usize).ok_or(FsError::NotFound)?;
                self.prefetcher.file_layout(batch)?.len
            }
            Node::Twin { batch } => return Ok(Attr::file(ino, self.twin(batch)?.len() as u64, Keep::All)),
        };
        Ok(Attr::file(ino, size, Keep::Attributes))
    }

    /// The names are listed alone (each lookup may lead to another file), and the twins' attributes cost
    /// the slot table.
    fn listed_whole(&self, ino: u64) -> bool {
        ino == ROLLING_DIR
    }

    /// One epoch's names (every epoch has as many batches), each as `owner`'s next open gets it.
    fn entries(&self, dir: u64, from: usize, max: usize, owner: u32) -> Result<Vec<Entry>, FsError> {
        if self.node(dir)? != Node::Dir {
            return Err(FsError::NotADirectory);
        }
        let manifest = self.prefetcher.manifest(self.state.first_epoch(), self.names.0)?;
        let listing = self.names.listing(manifest.batches.len(), from, max).into_iter();
        Ok(listing.map(|(batch, index, name)| Entry::new(self.named(batch, index, owner).ino(), false, name)).collect())
    }

    /// An open of a file moves its name on (its next lookup, the next open's, is the following epoch's
    /// file); an open of a twin makes `owner` an index-driven reader (with `rolling=auto`).
    fn opened(&self, ino: u64, who: Who) {
        match Node::from_ino(ino) {
            Some(Node::File { epoch, batch, file }) => {
                self.state.opened(batch, file, epoch);
                if file != RollingFile::Indexed {
                    self.state.hold(batch, file, epoch, who.owner);
                }
                if file == RollingFile::PackedIndex {
                    self.state.reads_twins(who.owner);
                }
            }
            Some(Node::Twin { .. }) => self.state.reads_twins(who.owner),
            Some(Node::Dir) | None => {}
        }
    }

    fn released(&self, ino: u64, owner: u32) {
        if let Some(Node::File { epoch, batch, file: file @ (RollingFile::Packed | RollingFile::PackedIndex) }) =
            Node::from_ino(ino)
        {
            self.state.release(batch, file, epoch, owner);
        }
    }

    fn read_failed(&self, ino: u64) {
        if let Some(Node::File { epoch, batch, file }) = Node::from_ino(ino) {
            self.state.read_failed(batch, file, epoch);
        }
    }

    fn closed(&self, ino: u64) {
        if let Some(Node::File { epoch, batch, file }) = Node::from_ino(ino) {
            self.prefetcher.closed(self.key(epoch, batch, file));
            self.state.closed(batch, file, epoch);
        }
    }

    /// A packed file is found by name by its process until released.
    fn adopted(&self, ino: u64, owner: u32) {
        if let Some(Node::File { epoch, batch, file: file @ (RollingFile::Packed | RollingFile::PackedIndex) }) =
            Node::from_ino(ino)
        {
            self.state.hold(batch, file, epoch, owner);
        }
    }

    fn record_in(&mut self, ledger: &Arc<Ledger>) {
        self.state.record_in(ledger.clone());
    }

    fn read(&self, ino: u64, offset: u64, size: u32, owner: u32) -> Result<Bytes, FsError> {
        match self.node(ino)? {
            Node::File { epoch, batch, file } => {
                match self.prefetcher.read(self.key(epoch, batch, file), offset, size, owner) {
                    Ok(bytes) => {
                        self.state.read_succeeded(batch, file, epoch);
                        Ok(bytes)
                    }
                    Err(e) => Err(e.into()),
                }
            }
            Node::Twin { batch } => {
                let text = self.twin(batch)?;
                let start = (offset as usize).min(text.len());
                Ok(text.slice(start..(start + size as usize).min(text.len())))
            }
            Node::Dir => Err(FsError::IsADirectory),
        }
    }

    fn backing(&self, ino: u64, owner: u32, _disk: bool) -> Result<Option<Backing>, FsError> {
        let file = match self.node(ino)? {
            Node::File { epoch, batch, file } => self.prefetcher.backing_file(self.key(epoch, batch, file), owner)?,
            Node::Twin { batch } => {
                let text = self.twin(batch)?;
                let file = crate::sys::memfd("batchfs-index")
                    .and_then(|mut f| std::io::Write::write_all(&mut f, &text).and_then(|_| crate::sys::seal(f)))
                    .map_err(|e| FsError::Io(ReadError::Backing(format!("the twin of rolling/ batch {batch}: {e}"))))?;
                Arc::new(file)
            }
            Node::Dir => return Err(FsError::IsADirectory),
        };
        Ok(Some(Backing { file, on_disk: false }))
    }
}
