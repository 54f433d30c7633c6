//! The listings a mount shows, as the prefetcher knows them: each epoch's manifest per format (the sizes
//! and checksums of its batch files; the last 16 used are kept) and the dataset's source files (`raw/`,
//! fetched once, seen as a manifest too so that its files are cached like batches). Also which next
//! epochs a background task is warming now, so that the reads near an epoch's end start one task, not one
//! each.
//!
//! Fetching is the coordinator's (it holds the client, the retries and the runtime); this room keeps
//! what was fetched and answers from it without blocking.

use crate::sync::{Arc, Mutex};
use batchfs::api::{BatchEntry, FileList, Manifest};
use batchfs::encode::BatchFormat;
use lru::LruCache;
use std::collections::HashSet;

/// Manifests kept at once: a few epochs ahead and behind, in every format a reader uses.
const MANIFESTS_KEPT: usize = 16;

pub(super) struct Listings {
    manifests: Mutex<LruCache<(u64, BatchFormat), Arc<Manifest>>>,
    /// The source files, and the same as a manifest.
    raw: Mutex<Option<Raw>>,
    /// Next epochs whose manifests a background task is fetching now.
    warming: Mutex<HashSet<u64>>,
}

/// The source files and their manifest.
#[derive(Clone)]
pub(super) struct Raw {
    pub files: Arc<FileList>,
    pub manifest: Arc<Manifest>,
}

/// What warming the next epoch needs: its manifest if cached, and the format of index twins to fetch
/// too (a reader of this epoch's DALI index twins reads all of the next epoch's at its pipeline build).
pub(super) struct NextEpoch {
    pub cached: Option<Arc<Manifest>>,
    pub twins: Option<BatchFormat>,
}

impl Listings {
    pub fn new() -> Self {
        Listings {
            manifests: Mutex::new(LruCache::new(std::num::NonZeroUsize::new(MANIFESTS_KEPT).expect("nonzero"))),
            raw: Mutex::new(None),
            warming: Mutex::new(HashSet::new()),
        }
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
        let idx = BatchFormat::TfrecordIdx;
        let twins = (format == BatchFormat::Tfrecord
            && epoch > 0
            && manifests.contains(&(epoch - 1, idx))
            && !manifests.contains(&(epoch, idx)))
        .then_some(idx);
        NextEpoch { cached: manifests.peek(&(epoch, format)).cloned(), twins }
    }

    /// Claims the warming of `epoch`: false when a task already has it.
    pub fn start_warming(&self, epoch: u64) -> bool {
        self.warming.lock().expect("warming").insert(epoch)
    }

    pub fn warmed(&self, epoch: u64) {
        self.warming.lock().expect("warming").remove(&epoch);
    }

    /// The source files, if fetched.
    pub fn raw(&self) -> Option<Raw> {
        self.raw.lock().expect("raw").clone()
    }

    /// Keeps the source files (the first list fetched wins, so every caller sees the same one) and
    /// derives their manifest: one entry per file, in the list's order.
    pub fn put_raw(&self, files: FileList) -> Raw {
        let mut raw = self.raw.lock().expect("raw");
        if let Some(raw) = &*raw {
            return raw.clone();
        }
        let batches: Vec<BatchEntry> = files
            .files
            .iter()
            .enumerate()
            .map(|(i, f)| BatchEntry { index: i as u64, samples: 1, bytes: f.size, crc32c: f.crc32c })
            .collect();
        let manifest = Manifest {
            dataset: String::new(),
            epoch: 0,
            options: Default::default(),
            format: BatchFormat::Tar,
            samples: batches.len() as u64,
            bytes: batches.iter().map(|b| b.bytes).sum(),
            batches,
        };
        let made = Raw { files: Arc::new(files), manifest: Arc::new(manifest) };
        *raw = Some(made.clone());
        made
    }

    /// The dataset path of source file `index`, if the list is here.
    pub fn raw_path(&self, index: u64) -> Option<String> {
        let raw = self.raw.lock().expect("raw");
        raw.as_ref().and_then(|r| r.files.files.get(index as usize)).map(|f| f.path.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfs::api::FileEntry;

    fn manifest(epoch: u64, format: BatchFormat) -> Manifest {
        Manifest {
            dataset: "d".into(),
            epoch,
            options: Default::default(),
            format,
            samples: 0,
            bytes: 0,
            batches: vec![],
        }
    }

    #[test]
    fn source_files_are_a_manifest_and_the_first_list_wins() {
        let listings = Listings::new();
        let entry = |path: &str, size| FileEntry { path: path.into(), size, crc32c: size as u32 };
        let raw = listings.put_raw(FileList { files: vec![entry("a/x.tar", 5), entry("b.tar", 7)] });
        assert_eq!(raw.manifest.bytes, 12);
        assert_eq!(raw.manifest.batches[1], BatchEntry { index: 1, samples: 1, bytes: 7, crc32c: 7 });
        listings.put_raw(FileList { files: vec![] });
        assert_eq!(listings.raw().unwrap().files.files.len(), 2);
        assert_eq!(listings.raw_path(0).as_deref(), Some("a/x.tar"));
        assert_eq!(listings.raw_path(2), None);
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
        assert!(listings.start_warming(2) && !listings.start_warming(2));
        listings.warmed(2);
        assert!(listings.start_warming(2));
    }
}
