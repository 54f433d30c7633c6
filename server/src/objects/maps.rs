//! Copies in the disk tier served by the path mapped shards take: an object the tier holds is mapped (its
//! copy, checked against the index before its first use in this process) and its body chunks are views of
//! the mapping, faulted in on the blocking pool (`body.rs`), as a local dataset's mapped shards are. No
//! copy of the bytes is made in the server's memory: under a memory cgroup smaller than the dataset, the
//! pages are the page cache's, reclaimed as any file's are.
//!
//! Mappings are kept for the most recently used `max_mapped_shards` objects (each is a kernel VMA); a
//! dataset of more objects than that (a file tree) reads its copies by positioned reads instead
//! (`fetch.rs`). A mapping whose copy the tier has evicted since is dropped when next looked at, and the
//! others every so often, so an evicted copy's disk space is not held for long.

use super::ObjectSource;
use batchfs::mmap::MappedFile;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// By object number: the copy's name in the tier and its mapping.
type Mapped = lru::LruCache<u32, (String, Arc<MappedFile>)>;

/// The mapped copies of one object dataset.
#[derive(Default)]
pub(super) struct Maps {
    /// None where copies are not mapped.
    maps: Mutex<Option<Mapped>>,
    /// Lookups, to look over every mapping now and then.
    lookups: AtomicU64,
}

/// How often (in lookups) every mapping is looked over for copies the tier evicted.
const PRUNE_EVERY: u64 = 256;

impl ObjectSource {
    /// Reads the copies that are not mapped with `O_DIRECT` (`on`), past the page cache.
    pub fn read_copies_directly(&self, on: bool) {
        self.direct_copies.store(on, Ordering::Relaxed);
    }

    /// Maps copies of at most `limit` objects at once (0: none; the copies are read by positioned reads).
    pub fn map_copies(&self, limit: usize) {
        let limit = std::num::NonZeroUsize::new(limit).filter(|_| self.tier().is_some());
        *self.maps.maps.lock().expect("maps") = limit.map(lru::LruCache::new);
    }

    /// Object `n`'s copy in the tier, mapped, if the tier holds one and copies are mapped: checked against
    /// the index before its first use in this process (a copy that differs is removed). Counts as a read
    /// of the object for the stager.
    pub fn mapping(self: &Arc<Self>, n: u32) -> Option<Arc<MappedFile>> {
        let tier = self.tier()?;
        let file = self.file(n)?;
        let mut guard = self.maps.maps.lock().expect("maps");
        let maps = guard.as_mut()?;
        if self.maps.lookups.fetch_add(1, Ordering::Relaxed).is_multiple_of(PRUNE_EVERY) {
            let gone: Vec<u32> = maps.iter().filter(|(_, (name, _))| !tier.contains(name)).map(|(n, _)| *n).collect();
            for n in gone {
                maps.pop(&n);
            }
        }
        if let Some((name, map)) = maps.get(&n) {
            // Counted as used, so that the copies bodies read now are not the ones evicted for the next.
            if tier.used(name) {
                let map = map.clone();
                drop(guard);
                self.touched(n, true);
                return Some(map);
            }
            maps.pop(&n);
        }
        drop(guard);
        let name = self.tier_name(file);
        let map = tier.get(&name).and_then(|(path, checked)| {
            let map = MappedFile::open(&path).ok().filter(|m| m.len() == file.size)?;
            if !checked {
                if let Some(k) = super::fetch::differing_chunk(file, map.bytes()) {
                    tier.remove(&name, &format!("chunk {k} differs from the index"));
                    return None;
                }
                tier.mark_checked(&name);
            }
            map.advise(memmap2::Advice::Random);
            Some(Arc::new(map))
        });
        self.touched(n, map.is_some());
        let map = map?;
        if let Some(maps) = self.maps.maps.lock().expect("maps").as_mut() {
            maps.put(n, (name, map.clone()));
        }
        Some(map)
    }

    /// Counts a read of `len` bytes served from a copy in the tier (mapped, read, or being made).
    pub fn served_from_tier(&self, len: u64) {
        if let Some(tier) = self.tier() {
            tier.counters.hits.fetch_add(1, Ordering::Relaxed);
            tier.counters.hit_bytes.fetch_add(len, Ordering::Relaxed);
        }
        self.counters.tier_hit_bytes.fetch_add(len, Ordering::Relaxed);
    }
}
