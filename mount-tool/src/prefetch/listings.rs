//! The epochs' listings as the prefetcher knows them: each epoch's manifest per format (the sizes and
//! checksums of its batch files; the last 16 used are kept), the slot table of `rolling/`'s indexed
//! layout, and which next epochs a background task is warming now, so that the reads near an epoch's end
//! start one task, not one each. (`raw/`'s directories are `raw.rs`'s.)
//!
//! Fetching is the coordinator's (it holds the client, the retries and the runtime); this room keeps
//! what was fetched and answers from it without blocking.

use super::{Listing, Target};
use crate::sync::{Arc, Mutex};
use batchfs::api::{Manifest, SlotTable};
use batchfs::encode::BatchFormat;
use lru::LruCache;
use std::collections::HashMap;

/// Manifests kept at once: a few epochs ahead and behind, in every format a reader uses.
const MANIFESTS_KEPT: usize = 16;

pub(super) struct Listings {
    manifests: Mutex<LruCache<(u64, BatchFormat), Arc<Manifest>>>,
    /// Listings of next epochs whose manifests a background task is fetching now.
    warming: Mutex<HashMap<Listing, Vec<Target>>>,
    /// The slot table of `rolling/`'s indexed layout, once fetched (it holds for the mount's life).
    slots: std::sync::OnceLock<Arc<SlotTable>>,
}

/// What warming the next epoch needs: its manifest if cached, and the format of index twins to fetch
/// too (a reader of this epoch's DALI index twins reads all of the next epoch's at its pipeline build).
pub struct NextEpoch {
    pub cached: Option<Arc<Manifest>>,
    pub twins: Option<BatchFormat>,
}

impl Listings {
    pub fn new() -> Self {
        Listings {
            manifests: Mutex::new(LruCache::new(std::num::NonZeroUsize::new(MANIFESTS_KEPT).expect("nonzero"))),
            warming: Mutex::new(HashMap::new()),
            slots: std::sync::OnceLock::new(),
        }
    }

    /// The slot table, if fetched.
    pub fn slot_table(&self) -> Option<Arc<SlotTable>> {
        self.slots.get().cloned()
    }

    /// Keeps the slot table (the first one kept wins, so every caller sees the same).
    pub fn put_slot_table(&self, table: SlotTable) -> Arc<SlotTable> {
        self.slots.get_or_init(|| Arc::new(table)).clone()
    }

    /// The manifest of `epoch` in `format`, if fetched (marks it used).
    pub fn manifest(&self, epoch: u64, format: BatchFormat) -> Option<Arc<Manifest>> {
        self.manifests.lock().expect("manifests").get(&(epoch, format)).cloned()
    }

    pub fn put_manifest(&self, manifest: Manifest) -> Arc<Manifest> {
        let manifest = Arc::new(manifest);
        let key = (manifest.epoch, manifest.format);
        self.manifests.lock().expect("manifests").put(key, manifest.clone());
        manifest
    }

    /// What warming `epoch` (in `format`) needs, without marking anything used.
    pub fn next_epoch(&self, epoch: u64, format: BatchFormat) -> NextEpoch {
        let manifests = self.manifests.lock().expect("manifests");
        let twins = format
            .index()
            .filter(|&idx| epoch > 0 && manifests.contains(&(epoch - 1, idx)) && !manifests.contains(&(epoch, idx)));
        NextEpoch { cached: manifests.peek(&(epoch, format)).cloned(), twins }
    }

    /// Claims the warming of `listing` (a next epoch's) for the targets of a read: false when a task
    /// already has it, which then also prefetches `targets` ([`Listings::warmed`]; another stream's, a
    /// range shard's start, where the first began at batch 0).
    pub fn start_warming(&self, listing: Listing, targets: &[Target]) -> bool {
        let mut warming = self.warming.lock().expect("warming");
        match warming.get_mut(&listing) {
            Some(pending) => {
                pending.extend(targets.iter().filter(|t| !pending.contains(t)).copied().collect::<Vec<_>>());
                false
            }
            None => {
                warming.insert(listing, Vec::new());
                true
            }
        }
    }

    /// The warming of `listing` ends: the targets other reads asked for meanwhile, to prefetch too. A read
    /// after this finds its objects at hand, or claims the warming anew.
    pub fn warmed(&self, listing: Listing) -> Vec<Target> {
        self.warming.lock().expect("warming").remove(&listing).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::views::{epochs::batches, rolling::placed};

    fn manifest(epoch: u64, format: BatchFormat) -> Manifest {
        Manifest {
            dataset: "d".into(),
            epoch,
            options: Default::default(),
            format,
            samples: 0,
            bytes: 0,
            batches: vec![],
            index_id: String::new(),
        }
    }

    #[test]
    fn the_next_epoch_gets_index_twins_only_after_a_reader_of_this_epochs_twins() {
        let listings = Listings::new();
        listings.put_manifest(manifest(1, BatchFormat::Tfrecord));
        let next = listings.next_epoch(1, BatchFormat::Tfrecord);
        assert!(next.cached.is_some() && next.twins.is_none());
        listings.put_manifest(manifest(1, BatchFormat::TfrecordIdx));
        let next = listings.next_epoch(2, BatchFormat::Tfrecord);
        assert!(next.cached.is_none());
        assert_eq!(next.twins, Some(BatchFormat::TfrecordIdx));
        listings.put_manifest(manifest(2, BatchFormat::TfrecordIdx));
        assert_eq!(listings.next_epoch(2, BatchFormat::Tfrecord).twins, None, "already here");
        assert_eq!(listings.next_epoch(2, BatchFormat::Tar).twins, None, "tar has no twins");
        let two = batches::listing(2, BatchFormat::Tfrecord);
        let at = |index| Target { listing: two, index };
        assert!(listings.start_warming(two, &[at(0), at(1)]));
        // Another stream's window (a range shard's start) while the task warms it: the task fetches those
        // too, once, when it is done (they were dropped, and fetched on demand).
        assert!(!listings.start_warming(two, &[at(50), at(51)]) && !listings.start_warming(two, &[at(51), at(52)]));
        assert!(listings.start_warming(placed::key(2, 0).listing, &[]), "another listing of the epoch");
        assert_eq!(listings.warmed(two), vec![at(50), at(51), at(52)]);
        assert!(listings.start_warming(two, &[]));
    }
}
