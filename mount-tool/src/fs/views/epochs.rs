//! The epoch folders: `epoch-NNNN/` holds epoch *N*'s batch files in plan order (`batch-000000.tfrecord`
//! with its DALI index `batch-000000.tfrecord.idx`, or `batch-000000.tar`), each a whole batch the
//! server sends in one response. Any epoch up to [`MAX_EPOCH`] resolves by name, listed or not; `stat`
//! and listings use the epoch's manifest only. The batch files' names and numbers are shared with
//! `rolling/` ([`BatchNames`], [`batch_ino`]), which shows one epoch's names.

use super::{Attr, Entry, Keep, View, Who};
use crate::fs::{Backing, FsError, FsOptions, ROOT};
use crate::prefetch::{ObjectKey, Prefetcher};
use batchfs::encode::BatchFormat;
use batchfs::plan::MAX_EPOCH;
use bytes::Bytes;
use std::sync::Arc;

pub mod batches;

const EPOCH_BASE: u64 = 1 << 40;
const BATCH_BASE: u64 = 1 << 62;
/// Batch numbers are below this (33 bits of a batch inode).
pub const MAX_BATCHES: u64 = 1 << 33;

/// The inode of file `kind` of batch `batch` of epoch `epoch` (kinds 0-1 this view's, 2-4 `rolling/`'s).
pub fn batch_ino(epoch: u64, batch: u64, kind: u64) -> u64 {
    BATCH_BASE | epoch << 36 | batch << 3 | kind
}

/// The (epoch, batch, kind) of a batch file's inode.
pub fn batch_of(ino: u64) -> Option<(u64, u64, u64)> {
    let rest = ino.checked_sub(BATCH_BASE)?;
    Some((rest >> 36, (rest >> 3) & (MAX_BATCHES - 1), rest & 7))
}

/// What an inode of this view is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    /// Epoch directory `e`.
    Dir(u64),
    /// A batch file of an epoch directory; `index` for its `.tfrecord.idx` twin.
    Batch { epoch: u64, batch: u64, index: bool },
}

impl Node {
    pub fn ino(self) -> u64 {
        match self {
            Node::Dir(e) => EPOCH_BASE + e,
            Node::Batch { epoch, batch, index } => batch_ino(epoch, batch, u64::from(index)),
        }
    }

    pub fn from_ino(ino: u64) -> Option<Node> {
        if (EPOCH_BASE..=EPOCH_BASE + MAX_EPOCH).contains(&ino) {
            return Some(Node::Dir(ino - EPOCH_BASE));
        }
        match batch_of(ino)? {
            (epoch, batch, kind @ (0 | 1)) => Some(Node::Batch { epoch, batch, index: kind == 1 }),
            _ => None,
        }
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

/// The epoch an epoch directory's name names.
pub fn parse_epoch(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("epoch-")?;
    let e: u64 = digits.parse().ok()?;
    (digits.bytes().all(|b| b.is_ascii_digit()) && epoch_name(e) == name && e <= MAX_EPOCH).then_some(e)
}

/// The names of one epoch's batch files, in the mount's format.
#[derive(Debug, Clone, Copy)]
pub struct BatchNames(pub BatchFormat);

impl BatchNames {
    /// The format of a batch file or of its twin as the server sends it.
    pub fn format(self, index: bool) -> BatchFormat {
        match self.0.index() {
            Some(idx) if index => idx,
            _ => self.0,
        }
    }

    /// The batch and whether it is the `.idx` twin, of a batch file's name.
    pub fn parse(self, name: &str) -> Option<(u64, bool)> {
        let rest = name.strip_prefix("batch-")?;
        let (digits, ext) = rest.split_once('.')?;
        let batch: u64 = digits.parse().ok()?;
        if !digits.bytes().all(|b| b.is_ascii_digit()) || format!("{batch:06}") != digits || batch >= MAX_BATCHES {
            return None;
        }
        match ext {
            e if e == self.0.as_str() => Some((batch, false)),
            "tfrecord.idx" if self.0 == BatchFormat::Tfrecord => Some((batch, true)),
            _ => None,
        }
    }

    /// At most `max` names from position `from` of a listing of `batches` batches: each batch file and its
    /// index twin, in order, as (batch, is the twin, name). Only those asked for are made.
    pub fn listing(self, batches: usize, from: usize, max: usize) -> Vec<(u64, bool, String)> {
        let per = if self.0.index().is_some() { 2 } else { 1 };
        let total = batches * per;
        let entry = |i: usize| {
            let (batch, index) = ((i / per) as u64, i % per == 1);
            (batch, index, batch_name(batch, self.format(index)))
        };
        (from.min(total)..total.min(from.saturating_add(max))).map(entry).collect()
    }

    /// The size of batch `batch` of epoch `epoch` (`index`: of its twin), from the epoch's manifest.
    pub fn size(self, prefetcher: &Prefetcher, epoch: u64, batch: u64, index: bool) -> Result<u64, FsError> {
        let manifest = prefetcher.manifest(epoch, self.format(index))?;
        Ok(manifest.batches.get(batch as usize).ok_or(FsError::NotFound)?.bytes)
    }

    /// What the server sends for batch `batch` of epoch `epoch` (`index`: its twin).
    pub fn key(self, epoch: u64, batch: u64, index: bool) -> ObjectKey {
        batches::key(epoch, batch, self.format(index))
    }
}

/// The view.
pub struct Epochs {
    prefetcher: Arc<Prefetcher>,
    names: BatchNames,
    /// Epoch directories the root lists: `epoch-0000` up to the job's last epoch (`first_epoch + epochs -
    /// 1`), so that a job restarted mid-run finds its epochs listed.
    epochs: u64,
}

impl Epochs {
    pub fn new(prefetcher: Arc<Prefetcher>, options: &FsOptions) -> Self {
        Epochs { prefetcher, names: BatchNames(options.format), epochs: options.first_epoch + options.epochs }
    }

    fn node(&self, ino: u64) -> Result<Node, FsError> {
        Node::from_ino(ino).ok_or(FsError::NotFound)
    }

    /// What batch file `ino` reads.
    fn key(&self, ino: u64) -> Result<ObjectKey, FsError> {
        match self.node(ino)? {
            Node::Batch { epoch, batch, index } => Ok(self.names.key(epoch, batch, index)),
            Node::Dir(_) => Err(FsError::IsADirectory),
        }
    }
}

impl View for Epochs {
    fn owns(&self, ino: u64) -> bool {
        Node::from_ino(ino).is_some()
    }

    fn in_root(&self) -> Vec<Entry> {
        self.root_page(0, usize::MAX)
    }

    fn root_len(&self) -> usize {
        self.epochs.min(MAX_EPOCH + 1) as usize
    }

    fn root_page(&self, from: usize, max: usize) -> Vec<Entry> {
        let listed = from.min(self.root_len())..self.root_len().min(from.saturating_add(max));
        listed.map(|e| Entry::new(Node::Dir(e as u64).ino(), true, epoch_name(e as u64))).collect()
    }

    fn root_lookup(&self, name: &str) -> Option<u64> {
        parse_epoch(name).map(|e| Node::Dir(e).ino())
    }

    fn parent(&self, _dir: u64) -> u64 {
        ROOT
    }

    fn lookup(&self, dir: u64, name: &str, _who: Who) -> Result<u64, FsError> {
        match self.node(dir)? {
            Node::Dir(epoch) => {
                let (batch, index) = self.names.parse(name).ok_or(FsError::NotFound)?;
                Ok(Node::Batch { epoch, batch, index }.ino())
            }
            Node::Batch { .. } => Err(FsError::NotADirectory),
        }
    }

    fn attr(&self, ino: u64) -> Result<Attr, FsError> {
        Ok(match self.node(ino)? {
            Node::Dir(_) => Attr::dir(ino),
            Node::Batch { epoch, batch, index } => {
                Attr::file(ino, self.names.size(&self.prefetcher, epoch, batch, index)?, Keep::All)
            }
        })
    }

    fn listed_whole(&self, _ino: u64) -> bool {
        true
    }

    fn entries(&self, dir: u64, from: usize, max: usize, _owner: u32) -> Result<Vec<Entry>, FsError> {
        let Node::Dir(epoch) = self.node(dir)? else { return Err(FsError::NotADirectory) };
        let manifest = self.prefetcher.manifest(epoch, self.names.0)?;
        let listing = self.names.listing(manifest.batches.len(), from, max).into_iter();
        Ok(listing
            .map(|(batch, index, name)| Entry::new(Node::Batch { epoch, batch, index }.ino(), false, name))
            .collect())
    }

    fn read(&self, ino: u64, offset: u64, size: u32, owner: u32) -> Result<Bytes, FsError> {
        Ok(self.prefetcher.read(self.key(ino)?, offset, size, owner)?)
    }

    fn backing(&self, ino: u64, owner: u32, _disk: bool) -> Result<Option<Backing>, FsError> {
        let file = self.prefetcher.backing_file(self.key(ino)?, owner)?;
        Ok(Some(Backing { file, on_disk: false }))
    }

    fn closed(&self, ino: u64) {
        if let Ok(key) = self.key(ino) {
            self.prefetcher.closed(key);
        }
    }
}
