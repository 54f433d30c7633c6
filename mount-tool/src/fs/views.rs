//! The views of the mount, each a module of its own behind [`View`]: it owns its names, its inode numbers,
//! its attributes and listings, what an open and a release of its files change, their reads and backing
//! files, and what it asks the prefetcher for: the kinds of its listings, each describing its objects to the
//! prefetcher ([`Kind`](crate::prefetch::kinds::Kind)), which matches on no view. The filesystem (`fs.rs`)
//! holds the root, lists and looks up in it what each view puts there, and hands every other inode to the
//! view that owns it; it knows no view by name. A new view is its module and one line of [`all`]
//! (docs/DESIGN.md, "Views").
//!
//! | view | in the root | module (`views/`) | its objects, to the prefetcher |
//! |---|---|---|---|
//! | the statistics | `.batchfs/stats` | `meta.rs` | none |
//! | the source files | `raw/` | `raw.rs`, `raw/tree.rs` | `raw/chunks.rs` |
//! | an epoch's names, opens serving the next | `rolling/` | `rolling.rs`, `rolling/state.rs` | `rolling/placed.rs` |
//! | class folders, opens the next sample | `shuffled/` | `shuffled.rs`, `shuffled/state.rs` | `shuffled/groups.rs` |
//! | the epoch folders | `epoch-NNNN/` | `epochs.rs` | `epochs/batches.rs` |
//!
//! Inode numbers encode what they name (`fs/inode.rs` holds the plan of who numbers what), so each view
//! decodes its own and no table grows with what is read.

use super::{Backing, FsError, FsOptions};
use crate::ledger::Ledger;
use crate::prefetch::Prefetcher;
use bytes::Bytes;
use std::sync::Arc;

pub mod epochs;
pub mod meta;
pub mod raw;
pub mod rolling;
pub mod shuffled;
pub mod undelivered;

/// Every view, in the order the root lists their names.
pub fn all(prefetcher: &Arc<Prefetcher>, options: &FsOptions) -> Vec<Box<dyn View>> {
    vec![
        Box::new(meta::Meta::new(prefetcher.clone())),
        Box::new(raw::Raw::new(prefetcher.clone(), options)),
        Box::new(rolling::Rolling::new(prefetcher.clone(), options)),
        Box::new(shuffled::Shuffled::new(prefetcher.clone(), options)),
        Box::new(epochs::Epochs::new(prefetcher.clone(), options)),
    ]
}

/// Who asks: the process (0: unknown) and its thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Who {
    pub owner: u32,
    pub tid: u32,
}

/// What the kernel may keep of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Its name and its attributes: the name always leads to it, and its contents never change.
    All,
    /// Its attributes, not the name that led to it: the next lookup of that name may lead elsewhere (a
    /// name of `rolling/` is a new file at each open, a name of `shuffled/` a new sample at each lookup).
    Attributes,
    /// Nothing: its contents are made at each open (the statistics).
    Nothing,
}

/// Attributes of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub dir: bool,
    pub size: u64,
    pub keep: Keep,
}

impl Attr {
    pub fn dir(ino: u64) -> Self {
        Attr { ino, dir: true, size: 0, keep: Keep::All }
    }

    pub fn file(ino: u64, size: u64, keep: Keep) -> Self {
        Attr { ino, dir: false, size, keep }
    }
}

/// An entry of a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub ino: u64,
    pub dir: bool,
    pub name: String,
}

impl Entry {
    pub fn new(ino: u64, dir: bool, name: impl Into<String>) -> Self {
        Entry { ino, dir, name: name.into() }
    }
}

/// How a file opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening {
    /// Its contents, read through the daemon or handed to the kernel.
    File,
    /// A snapshot made at the open, which the handle reads (the statistics).
    Snapshot,
}

/// One view of the dataset. Every method but those of the root is asked only of inodes [`View::owns`]
/// says are its own.
pub trait View: Send + Sync {
    /// Whether inode `ino` is one of this view's.
    fn owns(&self, ino: u64) -> bool;

    /// Its entries in the root, in order.
    fn in_root(&self) -> Vec<Entry>;

    /// How many entries it puts in the root.
    fn root_len(&self) -> usize {
        self.in_root().len()
    }

    /// At most `max` of its entries in the root, from position `from`: a view with many there (the epoch
    /// folders) makes only those, so that listing the root page by page costs each page its own entries.
    fn root_page(&self, from: usize, max: usize) -> Vec<Entry> {
        self.in_root().into_iter().skip(from).take(max).collect()
    }

    /// Its node named `name` in the root, if it puts one there.
    fn root_lookup(&self, name: &str) -> Option<u64>;

    /// The parent of directory `dir` (the root's inode where it is in the root).
    fn parent(&self, dir: u64) -> u64;

    /// Resolves `name` in directory `dir` for `who`.
    fn lookup(&self, dir: u64, name: &str, who: Who) -> Result<u64, FsError>;

    /// Attributes of `ino`; `NotFound` where it names nothing (yet).
    fn attr(&self, ino: u64) -> Result<Attr, FsError>;

    /// Whether a listing may carry `ino`'s entry and attributes (`READDIRPLUS`): where the kernel keeps
    /// both, and they cost no more than the listing.
    fn listed_whole(&self, ino: u64) -> bool;

    /// At most `max` entries of directory `dir` from position `from`, as `owner`'s next opens get them.
    fn entries(&self, dir: u64, from: usize, max: usize, owner: u32) -> Result<Vec<Entry>, FsError>;

    /// How file `ino` opens (after [`View::attr`] found it).
    fn open(&self, _ino: u64) -> Result<Opening, FsError> {
        Ok(Opening::File)
    }

    /// An open of `ino` by `who` succeeded: what it moves on (a failed open moves nothing).
    fn opened(&self, _ino: u64, _who: Who) {}

    /// Process `owner` released a handle of `ino` that [`View::opened`] counted.
    fn released(&self, _ino: u64, _owner: u32) {}

    /// The last handle of file `ino` was closed.
    fn closed(&self, _ino: u64) {}

    /// A read of file `ino` failed after waiting out `timeout` (or repeated such a failure at once).
    fn read_failed(&self, _ino: u64) {}

    /// Process `owner` holds a handle of `ino` opened under a worker before this one: held again as the
    /// open held it.
    fn adopted(&self, _ino: u64, _owner: u32) {}

    /// Writes the view's state through to `ledger` from now on, having taken what it holds (a worker
    /// before this one wrote it).
    fn record_in(&mut self, _ledger: &Arc<Ledger>) {}

    /// Reads `size` bytes at `offset` of file `ino` for process `owner`.
    fn read(&self, ino: u64, offset: u64, size: u32, owner: u32) -> Result<Bytes, FsError>;

    /// The verified contents of file `ino` for the kernel to serve, waited for as a read by `owner` is
    /// (`disk`: a file of the node cache may be handed over as it is); `None`: read through the daemon.
    fn backing(&self, ino: u64, owner: u32, disk: bool) -> Result<Option<Backing>, FsError>;
}
