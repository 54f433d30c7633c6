//! `.batchfs/`: the mount's own files. `stats` holds the live counters as JSON, a snapshot made at each
//! open (`batchfs stats` reads it).

use super::{Attr, Entry, Keep, Opening, View, Who};
use crate::fs::{Backing, FsError, ROOT};
use crate::prefetch::Prefetcher;
use bytes::Bytes;
use std::sync::Arc;

/// The name of the statistics directory.
pub const META_NAME: &str = ".batchfs";
/// `.batchfs`.
pub const META_DIR: u64 = 2;
/// `.batchfs/stats`.
pub const STATS_FILE: u64 = 3;

/// The view.
pub struct Meta {
    prefetcher: Arc<Prefetcher>,
}

impl Meta {
    pub fn new(prefetcher: Arc<Prefetcher>) -> Self {
        Meta { prefetcher }
    }
}

/// The statistics as `.batchfs/stats` shows them.
pub fn stats_json(prefetcher: &Prefetcher) -> Vec<u8> {
    let mut out = serde_json::to_vec_pretty(&prefetcher.stats.snapshot()).expect("stats serialize");
    out.push(b'\n');
    out
}

impl View for Meta {
    fn owns(&self, ino: u64) -> bool {
        ino == META_DIR || ino == STATS_FILE
    }

    fn in_root(&self) -> Vec<Entry> {
        vec![Entry::new(META_DIR, true, META_NAME)]
    }

    fn root_lookup(&self, name: &str) -> Option<u64> {
        (name == META_NAME).then_some(META_DIR)
    }

    fn parent(&self, _dir: u64) -> u64 {
        ROOT
    }

    fn lookup(&self, dir: u64, name: &str, _who: Who) -> Result<u64, FsError> {
        match dir {
            META_DIR if name == "stats" => Ok(STATS_FILE),
            META_DIR => Err(FsError::NotFound),
            _ => Err(FsError::NotADirectory),
        }
    }

    fn attr(&self, ino: u64) -> Result<Attr, FsError> {
        Ok(match ino {
            META_DIR => Attr::dir(META_DIR),
            _ => Attr::file(STATS_FILE, stats_json(&self.prefetcher).len() as u64, Keep::Nothing),
        })
    }

    fn listed_whole(&self, ino: u64) -> bool {
        ino == META_DIR
    }

    fn entries(&self, dir: u64, from: usize, max: usize, _owner: u32) -> Result<Vec<Entry>, FsError> {
        if dir != META_DIR {
            return Err(FsError::NotADirectory);
        }
        Ok([Entry::new(STATS_FILE, false, "stats")].into_iter().skip(from).take(max).collect())
    }

    fn open(&self, ino: u64) -> Result<Opening, FsError> {
        Ok(if ino == STATS_FILE { Opening::Snapshot } else { Opening::File })
    }

    fn read(&self, ino: u64, _offset: u64, _size: u32, _owner: u32) -> Result<Bytes, FsError> {
        // The statistics are read from their handle's snapshot.
        Err(if ino == META_DIR { FsError::IsADirectory } else { FsError::NotFound })
    }

    fn backing(&self, ino: u64, owner: u32, _disk: bool) -> Result<Option<Backing>, FsError> {
        self.read(ino, 0, 0, owner).map(|_| None)
    }
}
