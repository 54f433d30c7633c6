//! `raw/` (docs/SEMANTICS.md, "raw/"): the dataset directory's files as they are on the server, every
//! source, each directory listed from the server when first looked into (`raw/tree.rs` numbers them), each
//! file read in chunks the prefetcher fetches ahead in directory order (`raw/chunks.rs` says what they are;
//! the directories' lists are kept by the prefetcher, `prefetch/raw.rs`).

use super::{Attr, Entry, Keep, Opening, View, Who};
use crate::fs::{Backing, FsError, FsOptions, ROOT};
use crate::ledger::Ledger;
use crate::prefetch::Prefetcher;
use bytes::Bytes;
use std::sync::Arc;

pub mod chunks;
mod tree;
use tree::RawTree;

/// The name of the source-file tree.
pub const RAW_NAME: &str = "raw";
const DIR_BASE: u64 = 1 << 41;
const FILE_BASE: u64 = 1 << 42;

/// What an inode of this view is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    /// A directory of the tree (node 0 is `raw` itself).
    Dir(u32),
    /// A source file.
    File(u32),
}

impl Node {
    pub fn ino(self) -> u64 {
        match self {
            Node::Dir(n) => DIR_BASE + u64::from(n),
            Node::File(n) => FILE_BASE + u64::from(n),
        }
    }

    pub fn from_ino(ino: u64) -> Option<Node> {
        match ino {
            i if (DIR_BASE..DIR_BASE + (1 << 32)).contains(&i) => Some(Node::Dir((i - DIR_BASE) as u32)),
            i if (FILE_BASE..FILE_BASE + (1 << 32)).contains(&i) => Some(Node::File((i - FILE_BASE) as u32)),
            _ => None,
        }
    }
}

/// The view.
pub struct Raw {
    prefetcher: Arc<Prefetcher>,
    /// Shown (the `raw` option).
    shown: bool,
    tree: RawTree,
}

impl Raw {
    pub fn new(prefetcher: Arc<Prefetcher>, options: &FsOptions) -> Self {
        Raw { prefetcher, shown: options.raw, tree: RawTree::new() }
    }

    fn node(&self, ino: u64) -> Result<Node, FsError> {
        Node::from_ino(ino).ok_or(FsError::NotFound)
    }

    /// Directory node `n`, listed from the server if it is not yet (hidden: none).
    fn listed(&self, n: u32) -> Result<(), FsError> {
        if !self.shown {
            return Err(FsError::NotFound);
        }
        self.tree.listed(&self.prefetcher, n)
    }

    /// The directory id and position in it of file `ino`.
    fn file(&self, ino: u64) -> Result<(u32, u64), FsError> {
        match self.node(ino)? {
            Node::File(n) => self.tree.file(n),
            Node::Dir(_) => Err(FsError::IsADirectory),
        }
    }
}

impl View for Raw {
    fn owns(&self, ino: u64) -> bool {
        Node::from_ino(ino).is_some()
    }

    fn in_root(&self) -> Vec<Entry> {
        if !self.shown {
            return Vec::new();
        }
        vec![Entry::new(Node::Dir(0).ino(), true, RAW_NAME)]
    }

    fn root_lookup(&self, name: &str) -> Option<u64> {
        (name == RAW_NAME && self.shown).then(|| Node::Dir(0).ino())
    }

    fn parent(&self, dir: u64) -> u64 {
        match Node::from_ino(dir) {
            Some(Node::Dir(n)) if n != 0 => self.tree.parent(n).map_or(ROOT, |p| Node::Dir(p).ino()),
            _ => ROOT,
        }
    }

    fn lookup(&self, dir: u64, name: &str, _who: Who) -> Result<u64, FsError> {
        match self.node(dir)? {
            Node::Dir(n) => {
                self.listed(n)?;
                Ok(self.tree.lookup(n, name)?.ino())
            }
            Node::File(_) => Err(FsError::NotADirectory),
        }
    }

    fn attr(&self, ino: u64) -> Result<Attr, FsError> {
        match self.node(ino)? {
            Node::File(n) => {
                let (dir, file) = self.tree.file(n)?;
                Ok(Attr::file(ino, self.prefetcher.file_size(dir, file)?, Keep::All))
            }
            Node::Dir(n) if self.shown => self.tree.dir(n).map(|()| Attr::dir(ino)),
            Node::Dir(_) => Err(FsError::NotFound),
        }
    }

    /// A file this worker can name: not one an earlier worker numbered past the ledger's journal.
    fn open(&self, ino: u64) -> Result<Opening, FsError> {
        match self.node(ino)? {
            Node::File(n) => self.tree.file(n).map(|_| Opening::File),
            Node::Dir(_) => Ok(Opening::File),
        }
    }

    fn listed_whole(&self, _ino: u64) -> bool {
        true
    }

    fn entries(&self, dir: u64, from: usize, max: usize, _owner: u32) -> Result<Vec<Entry>, FsError> {
        let Node::Dir(n) = self.node(dir)? else { return Err(FsError::NotADirectory) };
        self.listed(n)?;
        let entries = self.tree.entries(n, from, max)?.into_iter();
        Ok(entries.map(|(name, node)| Entry::new(node.ino(), matches!(node, Node::Dir(_)), name)).collect())
    }

    fn closed(&self, ino: u64) {
        if let Ok((dir, file)) = self.file(ino) {
            for index in self.prefetcher.file_chunks(dir, file).unwrap_or_default() {
                self.prefetcher.closed(chunks::key(dir, index));
            }
        }
    }

    /// Listed again in the last worker's order before `raw/` answers, so every node keeps its number.
    fn record_in(&mut self, ledger: &Arc<Ledger>) {
        self.tree.record_in(ledger.clone(), self.prefetcher.clone());
    }

    fn read(&self, ino: u64, offset: u64, size: u32, owner: u32) -> Result<Bytes, FsError> {
        let (dir, file) = self.file(ino)?;
        Ok(chunks::read_file(&self.prefetcher, (dir, file), offset, size, owner)?)
    }

    /// With `disk`, a file the node cache holds whole is handed over as its file there (checked at the
    /// open, never copied into memory), up to [`crate::prefetch::DISK_WHOLE_MAX`]; else a file of one
    /// chunk by a memory file, and a larger one reads through the daemon, chunk by chunk, never held whole.
    fn backing(&self, ino: u64, owner: u32, disk: bool) -> Result<Option<Backing>, FsError> {
        let (dir, file) = self.file(ino)?;
        let raw = self.prefetcher.raw_dir(dir)?;
        let missing = || FsError::from(crate::prefetch::ReadError::NotFound(format!("source file #{file}")));
        let (chunks, whole) = (raw.chunks_of(file).ok_or_else(missing)?, raw.whole(file).ok_or_else(missing)?);
        if disk {
            if let Some(file) = self.prefetcher.disk_backing(whole) {
                return Ok(Some(Backing { file, on_disk: true }));
            }
        }
        if chunks.end - chunks.start != 1 {
            return Ok(None);
        }
        let key = chunks::key(dir, chunks.start);
        Ok(Some(Backing { file: self.prefetcher.backing_file(key, owner)?, on_disk: false }))
    }
}
