//! `raw/`'s tree of inodes: grown one directory at a time, when a lookup or a listing first looks into
//! it (the directory's list comes from the prefetcher, `prefetch/raw.rs`), so a tree of a million files
//! costs nothing until it is walked, and what is walked costs per directory. Node 0 is `raw` itself.
//!
//! **Across takeovers.** Each listing is journaled in the ledger in the order it numbered the tree, and the
//! count of numbered nodes kept beside it. A new worker lists the journaled directories again, in that
//! order, before it answers anything of `raw/`, so those nodes keep their numbers. When the journal filled
//! up, the nodes numbered after it (the kernel may hold them: dentries, attributes, cached pages, open
//! handles) are stale to the new worker (`ESTALE`, never another file's bytes), and it numbers what it lists
//! above all of them.

use super::Node;
use crate::fs::FsError;
use crate::ledger::Ledger;
use crate::prefetch::Prefetcher;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// One node of the tree.
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

/// The nodes by number, but for numbers an earlier worker handed out unjournaled (`stale`), which no node
/// of this worker takes: those after them are stored `stale.len()` places lower.
struct Nodes {
    list: Vec<RawNode>,
    stale: Range<u32>,
}

impl Nodes {
    /// Node `n`: `Stale` if an earlier worker numbered it past its journal.
    fn at(&self, n: u32) -> Result<&RawNode, FsError> {
        self.list.get(self.index(n)?).ok_or(FsError::NotFound)
    }

    fn at_mut(&mut self, n: u32) -> Result<&mut RawNode, FsError> {
        let i = self.index(n)?;
        self.list.get_mut(i).ok_or(FsError::NotFound)
    }

    fn index(&self, n: u32) -> Result<usize, FsError> {
        match n {
            n if n < self.stale.start => Ok(n as usize),
            n if n < self.stale.end => Err(FsError::Stale),
            n => Ok((n - self.stale.len() as u32) as usize),
        }
    }

    /// The number the next node takes.
    fn next(&self) -> u32 {
        self.list.len() as u32 + self.stale.len() as u32
    }

    /// Adds `node`: its number.
    fn push(&mut self, node: RawNode) -> u32 {
        let n = self.next();
        self.list.push(node);
        n
    }
}

/// Where `raw/`'s numbers start over a journal that cannot be followed: above every number a worker
/// could have handed out before (a tree of two billion nodes).
const UNKNOWN_FROM: u32 = 1 << 31;

/// The most room a journal record takes: its length, the node's number and a path of `PATH_MAX`.
const RECORD_MOST: usize = 4 + 4 + 4096;

/// Listings to make again: through this prefetcher, these (node, path), in order; then the nodes the last
/// worker numbered, all told.
type Replay = (Arc<Prefetcher>, Vec<(u32, String)>, u32);

/// The tree of `raw/`. With a ledger, each listing is journaled in the order it numbered the tree, and a
/// new worker lists the same directories again in that order before it answers anything of `raw/`, so that
/// every node keeps its number (the kernel holds them), or is stale if it was numbered past the journal.
pub(super) struct RawTree {
    nodes: Mutex<Nodes>,
    ledger: OnceLock<Arc<Ledger>>,
    /// The last worker's listings, (node, path) in order, until they are listed again.
    replay: Mutex<Option<Replay>>,
    replaying: AtomicBool,
}

impl RawTree {
    pub fn new() -> Self {
        let root = RawNode { parent: 0, kind: RawKind::Dir { path: String::new(), children: None } };
        RawTree {
            nodes: Mutex::new(Nodes { list: vec![root], stale: 0..0 }),
            ledger: OnceLock::new(),
            replay: Mutex::new(None),
            replaying: AtomicBool::new(false),
        }
    }

    /// Journals listings in `ledger` from now on; the listings it holds (a worker before this one listed
    /// them) are listed again, through `prefetcher`, before the tree answers.
    pub fn record_in(&self, ledger: Arc<Ledger>, prefetcher: Arc<Prefetcher>) {
        let listings: Vec<(u32, String)> = ledger
            .records()
            .into_iter()
            .filter_map(|r| {
                let n = u32::from_le_bytes(r.get(..4)?.try_into().ok()?);
                Some((n, String::from_utf8(r[4..].to_vec()).ok()?))
            })
            .collect();
        let numbered = ledger.raw_numbers();
        // No journal to follow: a release before the count of numbers went on journaling past a listing
        // that did not fit (the records after it name nodes no replay numbers alike), and numbered past
        // it unrecorded; a ledger left so is followed by no worker after. Every number handed out before
        // is stale, and this worker's are numbered from [`UNKNOWN_FROM`] on.
        let untrusted =
            numbered >= UNKNOWN_FROM || (numbered == 0 && !listings.is_empty() && ledger.journal_room() < RECORD_MOST);
        if untrusted {
            let from = numbered.max(UNKNOWN_FROM);
            tracing::warn!(
                numbered = from,
                "raw/: the ledger's journal cannot be followed (a worker of an older release filled it): every \
                 raw/ inode handed out before is stale (ESTALE) until looked up again"
            );
            self.nodes.lock().expect("raw tree").stale = 1..from;
            ledger.close_journal();
            ledger.raw_numbered(from);
            let _ = self.ledger.set(ledger);
            return;
        }
        if !listings.is_empty() || numbered > 1 {
            *self.replay.lock().expect("replay") = Some((prefetcher, listings, numbered));
            self.replaying.store(true, Ordering::Release);
        }
        let _ = self.ledger.set(ledger);
    }

    /// Lists the last worker's directories again, in its order (all asked for at once first), once; the
    /// nodes it numbered beyond them (past a full journal) are stale from then on.
    fn caught_up(&self) -> Result<(), FsError> {
        if !self.replaying.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut replay = self.replay.lock().expect("replay");
        let Some((prefetcher, listings, numbered)) = replay.as_ref() else { return Ok(()) };
        prefetcher.list_dirs_ahead(listings.iter().map(|(_, path)| path.clone()).collect());
        for (n, path) in listings {
            self.list(prefetcher, *n, false)?;
            tracing::debug!(n, path, "raw/: listed again as the last worker had");
        }
        let mut nodes = self.nodes.lock().expect("raw tree");
        let replayed = nodes.next();
        if *numbered > replayed {
            tracing::warn!(
                replayed,
                numbered,
                "raw/: the last worker numbered nodes past the ledger's journal: they are stale (ESTALE), \
                 and what is listed now is numbered after them"
            );
            nodes.stale = replayed..*numbered;
        }
        drop(nodes);
        *replay = None;
        self.replaying.store(false, Ordering::Release);
        Ok(())
    }

    fn node(nodes: &Nodes, n: u32) -> Result<Node, FsError> {
        Ok(match nodes.at(n)?.kind {
            RawKind::File { .. } => Node::File(n),
            RawKind::Dir { .. } => Node::Dir(n),
        })
    }

    /// Lists directory node `n` from the server (every page) if it is not listed yet, without holding
    /// the tree while it waits. When it is the second subdirectory of its parent to be listed, the
    /// parent's other subdirectories are listed ahead, in the background: a walk (ImageFolder's, `find`)
    /// looks into each in turn, and at 30 ms a thousand class folders listed one after another take half
    /// a minute; a look into one directory lists nothing more.
    pub fn listed(&self, prefetcher: &Arc<Prefetcher>, n: u32) -> Result<(), FsError> {
        self.caught_up()?;
        self.list(prefetcher, n, true)
    }

    /// [`Self::listed`], journaled when `journal`.
    fn list(&self, prefetcher: &Arc<Prefetcher>, n: u32, journal: bool) -> Result<(), FsError> {
        let path = {
            let nodes = self.nodes.lock().expect("raw tree");
            match &nodes.at(n)?.kind {
                RawKind::Dir { children: Some(_), .. } => return Ok(()),
                RawKind::Dir { path, children: None } => path.clone(),
                RawKind::File { .. } => return Err(FsError::NotADirectory),
            }
        };
        let (dir, list) = prefetcher.list_dir(&path)?;
        let mut nodes = self.nodes.lock().expect("raw tree");
        // Another thread may have listed it meanwhile: its nodes stand.
        if let RawKind::Dir { children: Some(_), .. } = &nodes.at(n)?.kind {
            return Ok(());
        }
        if let Some(ledger) = self.ledger.get().filter(|_| journal) {
            let mut record = n.to_le_bytes().to_vec();
            record.extend_from_slice(path.as_bytes());
            let was_full = ledger.journal_full();
            if !ledger.append(&record) && !was_full {
                tracing::warn!(
                    "the ledger's journal is full: a worker taking over this mount answers ESTALE for the raw/ \
                     inodes numbered from now on, until they are looked up again"
                );
            }
        }
        // Numbers only grow, takeover after takeover: past the last, nothing more is numbered (never one
        // number wrapped round onto another's node).
        let want = list.dirs.len() + list.files.len();
        if u64::from(nodes.next()) + want as u64 >= u64::from(u32::MAX) {
            tracing::error!(path, "raw/: its inode numbers are used up (remount the dataset)");
            return Err(FsError::Stale);
        }
        let prefix = if path.is_empty() { String::new() } else { format!("{path}/") };
        let mut children = Vec::with_capacity(want);
        for sub in &list.dirs {
            let kind = RawKind::Dir { path: format!("{prefix}{sub}"), children: None };
            children.push((sub.clone(), nodes.push(RawNode { parent: n, kind })));
        }
        for (file, entry) in list.files.iter().enumerate() {
            let name = entry.path.rsplit('/').next().unwrap_or_default();
            children.push((
                name.to_owned(),
                nodes.push(RawNode { parent: n, kind: RawKind::File { dir, file: file as u64 } }),
            ));
        }
        // Before any of them is answered: a worker taking over knows the kernel may hold them.
        if let Some(ledger) = self.ledger.get() {
            ledger.raw_numbered(nodes.next());
        }
        children.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if let RawKind::Dir { children: slot, .. } = &mut nodes.at_mut(n)?.kind {
            *slot = Some(children);
        }
        // A walk: the second sibling listed lists the rest ahead.
        let parent = nodes.at(n)?.parent;
        let siblings: Vec<(u32, bool)> = match nodes.at(parent).map(|p| &p.kind) {
            Ok(RawKind::Dir { children: Some(children), .. }) if n != 0 => children
                .iter()
                .filter_map(|&(_, c)| match &nodes.at(c).ok()?.kind {
                    RawKind::Dir { children, .. } => Some((c, children.is_some())),
                    RawKind::File { .. } => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        let ahead: Vec<String> = if siblings.iter().filter(|s| s.1).count() == 2 {
            siblings
                .iter()
                .filter(|s| !s.1)
                .filter_map(|&(c, _)| match &nodes.at(c).ok()?.kind {
                    RawKind::Dir { path, .. } => Some(path.clone()),
                    RawKind::File { .. } => None,
                })
                .collect()
        } else {
            Vec::new()
        };
        drop(nodes);
        prefetcher.list_dirs_ahead(ahead);
        Ok(())
    }

    /// Child `name` of directory node `n`, listed before (a binary search, whatever the directory's size).
    pub fn lookup(&self, n: u32, name: &str) -> Result<Node, FsError> {
        self.caught_up()?;
        let nodes = self.nodes.lock().expect("raw tree");
        let RawKind::Dir { children: Some(children), .. } = &nodes.at(n)?.kind else {
            return Err(FsError::NotFound);
        };
        let at = children.binary_search_by(|(child, _)| child.as_str().cmp(name)).map_err(|_| FsError::NotFound)?;
        Self::node(&nodes, children[at].1)
    }

    /// At most `max` entries of directory node `n`, listed before, from position `from`, by name.
    pub fn entries(&self, n: u32, from: usize, max: usize) -> Result<Vec<(String, Node)>, FsError> {
        self.caught_up()?;
        let nodes = self.nodes.lock().expect("raw tree");
        let RawKind::Dir { children: Some(children), .. } = &nodes.at(n)?.kind else {
            return Err(FsError::NotFound);
        };
        let slice = children.get(from..).unwrap_or_default();
        slice.iter().take(max).map(|(name, c)| Ok((name.clone(), Self::node(&nodes, *c)?))).collect()
    }

    /// Directory id and position of node `n`, if it is a file.
    pub fn file(&self, n: u32) -> Result<(u32, u64), FsError> {
        self.caught_up()?;
        match self.nodes.lock().expect("raw tree").at(n)?.kind {
            RawKind::File { dir, file } => Ok((dir, file)),
            RawKind::Dir { .. } => Err(FsError::NotFound),
        }
    }

    /// Whether node `n` is a directory: `NotFound` if it is not, `Stale` if an earlier worker numbered it
    /// past its journal.
    pub fn dir(&self, n: u32) -> Result<(), FsError> {
        // Not caught up (the server unreachable): no directory yet, as an unknown node is none.
        let _ = self.caught_up();
        match self.nodes.lock().expect("raw tree").at(n)?.kind {
            RawKind::Dir { .. } => Ok(()),
            RawKind::File { .. } => Err(FsError::NotFound),
        }
    }

    /// The parent of node `n`, if it exists.
    pub fn parent(&self, n: u32) -> Option<u32> {
        let _ = self.caught_up();
        self.nodes.lock().expect("raw tree").at(n).ok().map(|node| node.parent)
    }
}
