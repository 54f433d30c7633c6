//! `raw/`'s tree of inodes: grown one directory at a time, when a lookup or a listing first looks into
//! it (the directory's list comes from the prefetcher, `prefetch/raw.rs`), so a tree of a million files
//! costs nothing until it is walked, and what is walked costs per directory. Node 0 is `raw` itself.

use super::{FsError, Node};
use crate::prefetch::Prefetcher;
use std::sync::{Arc, Mutex};

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

/// The tree of `raw/`.
pub(super) struct RawTree(Mutex<Vec<RawNode>>);

impl RawTree {
    pub fn new() -> Self {
        RawTree(Mutex::new(vec![RawNode { parent: 0, kind: RawKind::Dir { path: String::new(), children: None } }]))
    }

    fn node(nodes: &[RawNode], n: u32) -> Node {
        match nodes[n as usize].kind {
            RawKind::File { .. } => Node::RawFile(n),
            RawKind::Dir { .. } => Node::RawDir(n),
        }
    }

    /// Lists directory node `n` from the server (every page) if it is not listed yet, without holding
    /// the tree while it waits. When it is the second subdirectory of its parent to be listed, the
    /// parent's other subdirectories are listed ahead, in the background: a walk (ImageFolder's, `find`)
    /// looks into each in turn, and at 30 ms a thousand class folders listed one after another take half
    /// a minute; a look into one directory lists nothing more.
    pub fn listed(&self, prefetcher: &Arc<Prefetcher>, n: u32) -> Result<(), FsError> {
        let path = {
            let nodes = self.0.lock().expect("raw tree");
            match &nodes.get(n as usize).ok_or(FsError::NotFound)?.kind {
                RawKind::Dir { children: Some(_), .. } => return Ok(()),
                RawKind::Dir { path, children: None } => path.clone(),
                RawKind::File { .. } => return Err(FsError::NotADirectory),
            }
        };
        let (dir, list) = prefetcher.list_dir(&path)?;
        let mut nodes = self.0.lock().expect("raw tree");
        // Another thread may have listed it meanwhile: its nodes stand.
        if let RawKind::Dir { children: Some(_), .. } = &nodes[n as usize].kind {
            return Ok(());
        }
        let prefix = if path.is_empty() { String::new() } else { format!("{path}/") };
        let mut children = Vec::with_capacity(list.dirs.len() + list.files.len());
        for sub in &list.dirs {
            let kind = RawKind::Dir { path: format!("{prefix}{sub}"), children: None };
            children.push((sub.clone(), nodes.len() as u32));
            nodes.push(RawNode { parent: n, kind });
        }
        for (file, entry) in list.files.iter().enumerate() {
            let name = entry.path.rsplit('/').next().unwrap_or_default();
            children.push((name.to_owned(), nodes.len() as u32));
            nodes.push(RawNode { parent: n, kind: RawKind::File { dir, file: file as u64 } });
        }
        children.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if let RawKind::Dir { children: slot, .. } = &mut nodes[n as usize].kind {
            *slot = Some(children);
        }
        // A walk: the second sibling listed lists the rest ahead.
        let parent = nodes[n as usize].parent;
        let siblings: Vec<(u32, bool)> = match &nodes[parent as usize].kind {
            RawKind::Dir { children: Some(children), .. } if n != 0 => children
                .iter()
                .filter_map(|&(_, c)| match &nodes[c as usize].kind {
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
                .filter_map(|&(c, _)| match &nodes[c as usize].kind {
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
        let nodes = self.0.lock().expect("raw tree");
        let RawKind::Dir { children: Some(children), .. } = &nodes[n as usize].kind else {
            return Err(FsError::NotFound);
        };
        let at = children.binary_search_by(|(child, _)| child.as_str().cmp(name)).map_err(|_| FsError::NotFound)?;
        Ok(Self::node(&nodes, children[at].1))
    }

    /// At most `max` entries of directory node `n`, listed before, from position `from`, by name.
    pub fn entries(&self, n: u32, from: usize, max: usize) -> Result<Vec<(String, Node)>, FsError> {
        let nodes = self.0.lock().expect("raw tree");
        let RawKind::Dir { children: Some(children), .. } = &nodes[n as usize].kind else {
            return Err(FsError::NotFound);
        };
        let slice = children.get(from..).unwrap_or_default();
        Ok(slice.iter().take(max).map(|(name, c)| (name.clone(), Self::node(&nodes, *c))).collect())
    }

    /// Directory id and position of node `n`, if it is a file.
    pub fn file(&self, n: u32) -> Result<(u32, u64), FsError> {
        match self.0.lock().expect("raw tree").get(n as usize).map(|node| &node.kind) {
            Some(&RawKind::File { dir, file }) => Ok((dir, file)),
            _ => Err(FsError::NotFound),
        }
    }

    /// Whether node `n` is a directory.
    pub fn is_dir(&self, n: u32) -> bool {
        matches!(self.0.lock().expect("raw tree").get(n as usize), Some(RawNode { kind: RawKind::Dir { .. }, .. }))
    }

    /// The parent of node `n`, if it exists.
    pub fn parent(&self, n: u32) -> Option<u32> {
        self.0.lock().expect("raw tree").get(n as usize).map(|node| node.parent)
    }
}
