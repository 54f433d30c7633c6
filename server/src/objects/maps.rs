//! Copies in the disk tier served by the path local shards take, kept open between reads: mapped, an
//! object the tier holds is mapped (its copy checked against the index before its first use in this
//! process, by a read on the blocking pool: `fetch.rs`) and its body chunks are views of the mapping,
//! faulted in on the blocking pool (`body.rs`), as a local dataset's mapped shards are; read directly (a
//! dataset larger than half the server's memory), its copy is opened with `O_DIRECT` and read by the
//! direct path of local shards (`fetch.rs`). No copy of the
//! bytes is made in the server's memory: under a memory cgroup smaller than the dataset, the pages are the
//! page cache's, reclaimed as any file's are.
//!
//! Mappings are kept for the most recently used `max_mapped_shards` objects (each is a kernel VMA); a
//! dataset of more objects than that (a file tree) reads its copies by positioned reads instead. Copies
//! opened for direct reads are kept for [`OPEN_COPIES`] objects: each piece of a chunk looked its copy up
//! by name (two MD5s) and opened it, 11 % of the server's CPU under PyTorch (docs/BENCHMARKS.md).
//!
//! **Evicted copies are let go at once.** Each kept copy is registered with the tier (`Tier::opened`), and
//! the kept copies are a [`super::tier::Keeper`]: the tier tells them of every copy it evicts or removes,
//! and they drop it then, so the copy is closed once the bodies reading it end, and its disk freed. Until
//! then the tier counts it. (Before, a kept copy was let go only when next looked up, or every 256
//! lookups: a server whose mounts had gone held 158 evicted copies mapped, their disk never freed.)

use super::tier::{Keeper, Tier};
use super::ObjectSource;
use batchfs::mmap::MappedFile;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Copies opened for direct reads kept at most, per dataset.
pub const OPEN_COPIES: usize = 1024;

/// Kept copies by object number: each copy's name in the tier and what holds it open.
type ByObject<T> = lru::LruCache<u32, (Arc<str>, T)>;

/// Copies of one object dataset kept open, by object number: each copy's name in the tier and what holds
/// it open (a mapping, or a file). Its lock is never held while calling the tier (the tier tells it of
/// copies let go with its own held).
pub(super) struct Kept<T> {
    /// None where copies are not kept so.
    copies: Mutex<Option<ByObject<T>>>,
}

impl<T> Default for Kept<T> {
    fn default() -> Self {
        Kept { copies: Mutex::new(None) }
    }
}

impl<T: Send> Keeper for Kept<T> {
    fn let_go(&self, name: &str) {
        if let Some(kept) = self.copies.lock().expect("kept copies").as_mut() {
            let gone: Vec<u32> = kept.iter().filter(|(_, (kept, _))| &**kept == name).map(|(n, _)| *n).collect();
            for n in gone {
                kept.pop(&n);
            }
        }
    }
}

impl<T: Clone> Kept<T> {
    /// Keeps at most `limit` copies from now on (0: none, and those kept are let go).
    fn limit(&self, limit: usize) {
        *self.copies.lock().expect("kept copies") = std::num::NonZeroUsize::new(limit).map(lru::LruCache::new);
    }

    /// Whether copies are kept so.
    fn on(&self) -> bool {
        self.copies.lock().expect("kept copies").is_some()
    }

    /// Object `n`'s copy kept, if `tier` holds it still (with `used`, counted as a use of it: the copies
    /// bodies read now are then not the ones evicted for the next); one the tier let go is let go here.
    pub(super) fn get(&self, tier: &Tier, n: u32, used: bool) -> Option<T> {
        let (name, copy) = self.copies.lock().expect("kept copies").as_mut()?.get(&n).cloned()?;
        if if used { tier.used(&name) } else { tier.contains(&name) } {
            return Some(copy);
        }
        self.drop_named(n, &name);
        None
    }

    /// Keeps object `n`'s copy `name`, held open by `copy` (where copies are kept so), unless the tier let
    /// it go meanwhile (it was told to the keepers before this kept it).
    pub(super) fn put(&self, tier: &Tier, n: u32, name: String, copy: T) {
        let name: Arc<str> = Arc::from(name);
        match self.copies.lock().expect("kept copies").as_mut() {
            Some(kept) => kept.put(n, (name.clone(), copy)),
            None => return,
        };
        if !tier.contains(&name) {
            self.drop_named(n, &name);
        }
    }

    /// Lets object `n`'s copy go where it is copy `name` (not one kept since).
    fn drop_named(&self, n: u32, name: &str) {
        if let Some(kept) = self.copies.lock().expect("kept copies").as_mut() {
            if kept.peek(&n).is_some_and(|(kept, _)| &**kept == name) {
                kept.pop(&n);
            }
        }
    }

    /// Lets object `n`'s copy go (a read of it failed).
    pub(super) fn forget(&self, n: u32) {
        if let Some(kept) = self.copies.lock().expect("kept copies").as_mut() {
            kept.pop(&n);
        }
    }

    /// How many are kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.copies.lock().expect("kept copies").as_ref().map_or(0, lru::LruCache::len)
    }
}

impl ObjectSource {
    /// Reads the copies that are not mapped with `O_DIRECT` (`on`), past the page cache, keeping those of
    /// `OPEN_COPIES` objects open.
    pub fn read_copies_directly(&self, on: bool) {
        self.direct_copies.store(on, Ordering::Relaxed);
        self.open_copies.limit(if on && self.tier().is_some() { OPEN_COPIES } else { 0 });
    }

    /// Maps copies of at most `limit` objects at once (0: none; the copies are read by positioned reads).
    pub fn map_copies(&self, limit: usize) {
        self.maps.limit(if self.tier().is_some() { limit } else { 0 });
    }

    /// Object `n`'s copy in the tier, mapped, if the tier holds one checked and copies are mapped. Counts
    /// as a read of the object for the stager. A copy found at start and not checked yet is not mapped:
    /// this runs in a body's `poll_frame`, on a worker, and the bytes are read on the blocking pool instead
    /// ([`ObjectSource::read_many`]), which checks it first, once; its next reads are mapped. (Before, it
    /// was mapped and checked whole here, a worker stalled for as long, by every body reaching it at once.)
    pub fn mapping(self: &Arc<Self>, n: u32) -> Option<Arc<MappedFile>> {
        let tier = self.tier()?;
        let file = self.file(n)?;
        if !self.maps.on() {
            return None;
        }
        if let Some(map) = self.maps.get(tier, n, true) {
            self.touched(n, true);
            return Some(map);
        }
        let name = self.tier_name(file);
        if tier.is_unchecked(&name) {
            return None;
        }
        let map = tier.get(&name).and_then(|(path, checked)| {
            let map = MappedFile::open(&path).ok().filter(|m| checked && m.len() == file.size)?;
            map.advise(memmap2::Advice::Random);
            let map = Arc::new(map);
            // Counted by the tier, once evicted, until the last body reading it is done.
            tier.opened(&name, Arc::downgrade(&map) as super::tier::Opened).then_some(map)
        });
        self.touched(n, map.is_some());
        let map = map?;
        self.maps.put(tier, n, name, map.clone());
        Some(map)
    }

    /// Lets object `n`'s mapped copy go where the file was truncated under the server (by hand, or a disk
    /// tool): a page past its new end was read, which reads zeros ([`MappedFile::was_cut`]). The copy is
    /// removed from the tier, and the object read from the store (and copied) again. It was kept and
    /// served on: every body that touched its end sent zeros (refused by the clients' checksums, each
    /// read of the mount failing until its `timeout`), and nothing said so. Returns whether it did.
    pub fn drop_cut_copy(&self, n: u32) -> bool {
        // Checked before every body: nothing to look at (two locks and the LRU's order) until one is cut.
        if !batchfs::mmap::any_cut() {
            return false;
        }
        let (Some(tier), Some(file)) = (self.tier(), self.file(n)) else { return false };
        match self.maps.get(tier, n, false) {
            Some(map) if map.was_cut() => {
                tier.remove(&self.tier_name(file), "truncated under the server: a page past its end read zeros");
                self.maps.forget(n);
                true
            }
            _ => false,
        }
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
