//! `shuffled/` (docs/SEMANTICS.md, "shuffled/"): a file tree's samples by class, each name of class
//! folder *c* a new sample of class *c* in plan order at each lookup, as ImageFolder's shuffled reads ask
//! for them. Who gets which sample, and the windows a lookup starts, are `shuffled/state.rs`; what a group
//! of samples is to the prefetcher, and the reads of samples from their groups, are `shuffled/groups.rs`;
//! the plans are kept by the prefetcher (`prefetch/shuffled.rs`).

use super::{Attr, Entry, Keep, View, Who};
use crate::fs::{Backing, FsError, FsOptions, ROOT};
use crate::ledger::Ledger;
use crate::prefetch::{Prefetcher, WINDOW_GROUPS};
use bytes::Bytes;
use std::sync::Arc;

pub mod groups;
mod state;
use state::ShuffledView;

/// The name of the class-folder view.
pub const SHUFFLED_NAME: &str = "shuffled";
/// `shuffled/`.
pub const SHUFFLED_DIR: u64 = 5;
const CLASS_BASE: u64 = 1 << 44;
const SAMPLE_BASE: u64 = 1 << 61;
const SAMPLE_END: u64 = 1 << 62;
/// Classes are below this (17 bits of a sample's inode).
pub const MAX_CLASSES: u64 = 1 << 17;
/// Samples of one class in one epoch (of a mount's share) are below this (24 bits).
pub const MAX_CLASS_SAMPLES: u64 = 1 << 24;

/// What an inode of this view is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    /// `shuffled/`.
    Dir,
    /// A class folder.
    Class(u32),
    /// Sample `k` of class `class` in epoch `epoch` (this mount's share, plan order), as a lookup of a
    /// name of the class got it.
    Sample { epoch: u64, class: u32, k: u64 },
}

impl Node {
    pub fn ino(self) -> u64 {
        match self {
            Node::Dir => SHUFFLED_DIR,
            Node::Class(c) => CLASS_BASE + u64::from(c),
            Node::Sample { epoch, class, k } => SAMPLE_BASE | epoch << 41 | u64::from(class) << 24 | k,
        }
    }

    pub fn from_ino(ino: u64) -> Option<Node> {
        match ino {
            SHUFFLED_DIR => Some(Node::Dir),
            i if (CLASS_BASE..CLASS_BASE + MAX_CLASSES).contains(&i) => Some(Node::Class((i - CLASS_BASE) as u32)),
            i if (SAMPLE_BASE..SAMPLE_END).contains(&i) => {
                let rest = i - SAMPLE_BASE;
                let epoch = rest >> 41;
                let class = ((rest >> 24) & (MAX_CLASSES - 1)) as u32;
                let k = rest & (MAX_CLASS_SAMPLES - 1);
                (epoch <= batchfs::plan::MAX_EPOCH).then_some(Node::Sample { epoch, class, k })
            }
            _ => None,
        }
    }
}

/// The view.
pub struct Shuffled {
    prefetcher: Arc<Prefetcher>,
    state: ShuffledView,
    /// The samples read of each group.
    reads: groups::Reads,
    first_epoch: u64,
    epochs: u64,
}

impl Shuffled {
    pub fn new(prefetcher: Arc<Prefetcher>, options: &FsOptions) -> Self {
        // Inode numbers hold 17 bits of class: a tree of more first directories is not a class-folder tree.
        let classes = if options.classes.len() as u64 > MAX_CLASSES {
            tracing::warn!(classes = options.classes.len(), "no shuffled/: more first directories than it numbers");
            Vec::new()
        } else {
            options.classes.clone()
        };
        if !classes.is_empty() {
            prefetcher.stats.shuffled_window.store(WINDOW_GROUPS, std::sync::atomic::Ordering::Relaxed);
        }
        let state = ShuffledView::new(classes, options.first_epoch, options.epochs);
        Shuffled {
            prefetcher,
            state,
            reads: Default::default(),
            first_epoch: options.first_epoch,
            epochs: options.epochs,
        }
    }

    /// The node `ino` names, if the view is shown and it names one of its classes.
    fn node(&self, ino: u64) -> Result<Node, FsError> {
        let classes = self.state.classes.len();
        match Node::from_ino(ino) {
            _ if classes == 0 => Err(FsError::NotFound),
            Some(Node::Class(c) | Node::Sample { class: c, .. }) if c as usize >= classes => Err(FsError::NotFound),
            Some(node) => Ok(node),
            None => Err(FsError::NotFound),
        }
    }

    /// The sample the lookup of `name` in class `class` by thread `tid` gets, and the windows it starts.
    fn sample(&self, class: u32, name: &str, tid: u32) -> Result<Node, FsError> {
        let names = self.state.names(&self.prefetcher, class)?;
        names.binary_search_by(|n| n.as_str().cmp(name)).map_err(|_| FsError::NotFound)?;
        let samples = names.len() as u64;
        if samples >= MAX_CLASS_SAMPLES {
            return Err(FsError::NotFound);
        }
        let (epoch, k) = self.state.reserve(tid, class, samples).ok_or(FsError::NotFound)?;
        let plan = self.state.plan(&self.prefetcher, epoch)?;
        if self.state.first_time(epoch) {
            for c in 0..plan.order.len() {
                groups::prefetch(&self.prefetcher, &plan, c, 0..WINDOW_GROUPS);
            }
        }
        // The groups holding the class's next samples, on into the next epoch's when they run past.
        let (here, next) = state::window(k, plan.group as u64, samples, self.state.window_groups());
        groups::prefetch(&self.prefetcher, &plan, class as usize, here);
        if !next.is_empty() {
            let next_plan = self.state.plan(&self.prefetcher, self.next_epoch(epoch))?;
            groups::prefetch(&self.prefetcher, &next_plan, class as usize, next);
        }
        Ok(Node::Sample { epoch, class, k })
    }

    /// The epoch after `epoch` in the job's span (after its last, its first).
    fn next_epoch(&self, epoch: u64) -> u64 {
        let next = epoch + 1;
        if next >= self.first_epoch + self.epochs.max(1) {
            self.first_epoch
        } else {
            next
        }
    }
}

impl View for Shuffled {
    fn owns(&self, ino: u64) -> bool {
        Node::from_ino(ino).is_some()
    }

    fn in_root(&self) -> Vec<Entry> {
        if self.state.classes.is_empty() {
            return Vec::new();
        }
        vec![Entry::new(SHUFFLED_DIR, true, SHUFFLED_NAME)]
    }

    fn root_lookup(&self, name: &str) -> Option<u64> {
        (name == SHUFFLED_NAME && !self.state.classes.is_empty()).then_some(SHUFFLED_DIR)
    }

    fn parent(&self, dir: u64) -> u64 {
        match Node::from_ino(dir) {
            Some(Node::Class(_)) => SHUFFLED_DIR,
            _ => ROOT,
        }
    }

    fn lookup(&self, dir: u64, name: &str, who: Who) -> Result<u64, FsError> {
        let node = match self.node(dir)? {
            Node::Dir => {
                self.state.ahead(&self.prefetcher);
                Node::Class(self.state.class(name).ok_or(FsError::NotFound)?)
            }
            Node::Class(class) => self.sample(class, name, who.tid)?,
            Node::Sample { .. } => return Err(FsError::NotADirectory),
        };
        Ok(node.ino())
    }

    fn attr(&self, ino: u64) -> Result<Attr, FsError> {
        match self.node(ino)? {
            Node::Dir | Node::Class(_) => Ok(Attr::dir(ino)),
            Node::Sample { epoch, class, k } => {
                let plan = self.state.plan(&self.prefetcher, epoch)?;
                let id = plan.order.get(class as usize).and_then(|o| o.get(k as usize)).ok_or(FsError::NotFound)?;
                Ok(Attr::file(ino, self.prefetcher.sample_table()?.bytes[*id as usize], Keep::Attributes))
            }
        }
    }

    /// A sample's name is listed alone: each lookup of it hands out a sample.
    fn listed_whole(&self, ino: u64) -> bool {
        !matches!(Node::from_ino(ino), Some(Node::Sample { .. }))
    }

    /// The class folders, or a class folder's names (their inodes stand for no sample: a lookup hands one
    /// out). Listed, the class folders' names come with their entries (`READDIRPLUS`) and a walk looks
    /// none of them up: a listing asks ahead as the first lookup would.
    fn entries(&self, dir: u64, from: usize, max: usize, _owner: u32) -> Result<Vec<Entry>, FsError> {
        let node = self.node(dir)?;
        if matches!(node, Node::Sample { .. }) {
            return Err(FsError::NotADirectory);
        }
        self.state.ahead(&self.prefetcher);
        Ok(match node {
            Node::Class(class) => {
                let names = self.state.names(&self.prefetcher, class)?;
                let epoch = self.first_epoch;
                let entry =
                    |(k, n): (usize, &String)| Entry::new(Node::Sample { epoch, class, k: k as u64 }.ino(), false, n);
                names.iter().enumerate().skip(from).take(max).map(entry).collect()
            }
            _ => {
                let classes = self.state.classes.iter().enumerate().skip(from).take(max);
                classes.map(|(c, n)| Entry::new(Node::Class(c as u32).ino(), true, n)).collect()
            }
        })
    }

    /// The sample is the thread's file now.
    fn opened(&self, ino: u64, who: Who) {
        if let Some(Node::Sample { epoch, class, k }) = Node::from_ino(ino) {
            self.state.opened(who.tid, class, epoch, k);
        }
    }

    fn record_in(&mut self, ledger: &Arc<Ledger>) {
        self.state.record_in(ledger.clone());
    }

    fn read_failed(&self, ino: u64) {
        if let Some(Node::Sample { epoch, class, k }) = Node::from_ino(ino) {
            self.state.read_failed(class, epoch, k);
        }
    }

    /// A sample no read of got (each failed) goes back to be handed out again.
    fn closed(&self, ino: u64) {
        if let Some(Node::Sample { epoch, class, k }) = Node::from_ino(ino) {
            self.state.closed(class, epoch, k);
        }
    }

    /// A group is consumed once its last sample is read to its end (the prefetcher marks it).
    fn read(&self, ino: u64, offset: u64, size: u32, owner: u32) -> Result<Bytes, FsError> {
        let Node::Sample { epoch, class, k } = self.node(ino)? else { return Err(FsError::IsADirectory) };
        let plan = self.state.plan(&self.prefetcher, epoch)?;
        let read = self.reads.read(&self.prefetcher, (&plan, class as usize, k), offset, size, owner);
        let (bytes, stalled) = match read {
            Ok(read) => {
                self.state.read_succeeded(class, epoch, k);
                read
            }
            Err(e) => return Err(e.into()),
        };
        if stalled && self.state.stalled(k, plan.group as u64, plan.most_window) {
            let groups = self.state.window_groups();
            self.prefetcher.stats.shuffled_window.store(groups, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(bytes)
    }

    /// With `disk`, a sample the node cache holds is handed over as its file there (checked at the open;
    /// its group is then not fetched at all, `groups.rs`). Else none: a sample is part of its group, and a
    /// memory file of its own per open costs more than the reads it saves.
    fn backing(&self, ino: u64, _owner: u32, disk: bool) -> Result<Option<Backing>, FsError> {
        let Node::Sample { epoch, class, k } = self.node(ino)? else { return Err(FsError::IsADirectory) };
        if !disk {
            return Ok(None);
        }
        let plan = self.state.plan(&self.prefetcher, epoch)?;
        let file = self.reads.from_disk(&self.prefetcher, (&plan, class as usize, k))?;
        Ok(file.map(|file| Backing { file, on_disk: true }))
    }
}
