//! The listings a mount shows, as the prefetcher knows them: each epoch's manifest per format (the sizes
//! and checksums of its batch files; the last 16 used are kept) and the directories of the dataset's
//! files (`raw/`), each listed once, when first looked into, and seen as a manifest of chunks so that
//! its files are cached like batches: each file of more than one chunk is fetched and checked chunk by
//! chunk, in ranges. Also which next
//! epochs a background task is warming now, so that the reads near an epoch's end start one task, not one
//! each.
//!
//! Fetching is the coordinator's (it holds the client, the retries and the runtime); this room keeps
//! what was fetched and answers from it without blocking.

use super::Listing;
use crate::sync::{Arc, Mutex};
use batchfs::api::{BatchEntry, FileEntry, FileList, Manifest, SlotTable};
use batchfs::encode::BatchFormat;
use lru::LruCache;
use std::collections::HashSet;

/// Manifests kept at once: a few epochs ahead and behind, in every format a reader uses.
const MANIFESTS_KEPT: usize = 16;

pub(super) struct Listings {
    manifests: Mutex<LruCache<(u64, BatchFormat), Arc<Manifest>>>,
    /// The directories of `raw/` listed so far.
    raw: Mutex<RawDirs>,
    /// Listings of next epochs whose manifests a background task is fetching now.
    warming: Mutex<HashSet<Listing>>,
    /// The slot table of `rolling/`'s indexed layout, once fetched (it holds for the mount's life).
    slots: std::sync::OnceLock<Arc<SlotTable>>,
}

/// The directories of `raw/` listed so far, by id (the order they were listed in) and by path.
#[derive(Default)]
struct RawDirs {
    dirs: Vec<Raw>,
    by_path: std::collections::HashMap<String, u32>,
}

/// One directory of `raw/`: its subdirectories, its files and their manifest of chunks.
#[derive(Clone)]
pub(super) struct Raw {
    /// Every page of the directory's list, merged (`dirs` without repeats).
    pub files: Arc<FileList>,
    /// One entry per chunk: the chunks of file 0, then of file 1, and so on.
    pub manifest: Arc<Manifest>,
    /// The first chunk of each file, and the number of chunks last.
    pub first_chunk: Arc<Vec<u64>>,
    /// A DALI index (`*.idx`) of this directory was read: every other one was asked for.
    indexes_warmed: Arc<std::sync::atomic::AtomicBool>,
}

impl Raw {
    /// The chunks of file `file`, if it exists.
    pub fn chunks_of(&self, file: u64) -> Option<std::ops::Range<u64>> {
        let f = file as usize;
        Some(*self.first_chunk.get(f)?..*self.first_chunk.get(f + 1)?)
    }

    /// The file holding chunk `chunk`, and the chunk's offset in it.
    pub fn chunk(&self, chunk: u64) -> Option<(&FileEntry, u64)> {
        let file = self.first_chunk.partition_point(|&c| c <= chunk).checked_sub(1)?;
        let entry = self.files.files.get(file)?;
        Some((entry, (chunk - self.first_chunk[file]) * self.files.chunk_bytes))
    }
}

/// The CRC32C of each chunk of `file`, of `chunk_bytes` each: the one CRC of the whole file when the
/// list gives no chunks, or gives a number that does not match the size, or a chunk size of 0 (fetched
/// whole then).
fn chunk_crcs(file: &FileEntry, chunk_bytes: u64) -> Vec<(u64, u32)> {
    let n = file.size.div_ceil(chunk_bytes.max(1));
    if chunk_bytes == 0 || file.chunks.is_empty() || file.chunks.len() as u64 != n || n < 2 {
        return vec![(file.size, file.crc32c)];
    }
    let mut left = file.size;
    file.chunks
        .iter()
        .map(|&crc| {
            let len = left.min(chunk_bytes);
            left -= len;
            (len, crc)
        })
        .collect()
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
            raw: Mutex::new(RawDirs::default()),
            warming: Mutex::new(HashSet::new()),
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

    /// The chunks of every DALI index (`*.idx`) of directory `dir` of `raw/`, the first time a read of
    /// its chunk `chunk` is one of them (DALI reads all of them, one after another, when its pipeline is
    /// built; they are small); empty otherwise.
    pub fn raw_indexes_at(&self, dir: u32, chunk: u64) -> Vec<u64> {
        use std::sync::atomic::Ordering;
        let Some(raw) = self.raw(dir) else { return Vec::new() };
        // Every read of raw/ asks: once done, the answer is at hand.
        if raw.indexes_warmed.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let is_index = |c| raw.chunk(c).is_some_and(|(f, _)| f.path.ends_with(".idx"));
        if !is_index(chunk) || raw.indexes_warmed.swap(true, Ordering::Relaxed) {
            return Vec::new();
        }
        (0..raw.files.files.len() as u64)
            .filter(|&f| raw.files.files[f as usize].path.ends_with(".idx"))
            .filter_map(|f| raw.chunks_of(f))
            .flatten()
            .filter(|&c| c != chunk)
            .collect()
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

    /// Claims the warming of `listing` (a next epoch's): false when a task already has it.
    pub fn start_warming(&self, listing: Listing) -> bool {
        self.warming.lock().expect("warming").insert(listing)
    }

    pub fn warmed(&self, listing: Listing) {
        self.warming.lock().expect("warming").remove(&listing);
    }

    /// Directory `dir` of `raw/`, if listed.
    pub fn raw(&self, dir: u32) -> Option<Raw> {
        self.raw.lock().expect("raw").dirs.get(dir as usize).cloned()
    }

    /// The directory of `raw/` at `path`, if listed, and its id.
    pub fn raw_at(&self, path: &str) -> Option<(u32, Raw)> {
        let raw = self.raw.lock().expect("raw");
        raw.by_path.get(path).map(|&id| (id, raw.dirs[id as usize].clone()))
    }

    /// Keeps a directory's list (every page merged; the first list of a path wins, so every caller
    /// sees the same one) and derives its manifest: one entry per chunk, file after file in the list's
    /// order. Returns its id.
    pub fn put_raw(&self, mut files: FileList) -> (u32, Raw) {
        let mut raw = self.raw.lock().expect("raw");
        if let Some(&id) = raw.by_path.get(&files.dir) {
            return (id, raw.dirs[id as usize].clone());
        }
        let mut batches: Vec<BatchEntry> = Vec::with_capacity(files.files.len());
        let mut first_chunk = Vec::with_capacity(files.files.len() + 1);
        for file in &mut files.files {
            first_chunk.push(batches.len() as u64);
            let chunks = chunk_crcs(file, files.chunk_bytes);
            if chunks.len() == 1 {
                // Fetched whole: the chunk list, if any, is not needed.
                file.chunks = Vec::new();
            }
            for (bytes, crc32c) in chunks {
                batches.push(BatchEntry { index: batches.len() as u64, samples: 1, bytes, crc32c });
            }
        }
        first_chunk.push(batches.len() as u64);
        let manifest = Manifest {
            dataset: String::new(),
            epoch: 0,
            options: Default::default(),
            format: BatchFormat::Tar,
            samples: batches.len() as u64,
            bytes: batches.iter().map(|b| b.bytes).sum(),
            batches,
        };
        let id = raw.dirs.len() as u32;
        raw.by_path.insert(files.dir.clone(), id);
        let made = Raw {
            files: Arc::new(files),
            manifest: Arc::new(manifest),
            first_chunk: Arc::new(first_chunk),
            indexes_warmed: Default::default(),
        };
        raw.dirs.push(made.clone());
        (id, made)
    }

    /// The dataset path of the file of directory `dir` holding chunk `chunk`, and the chunk's offset in
    /// it, if the directory is listed.
    pub fn raw_chunk(&self, dir: u32, chunk: u64) -> Option<(String, u64)> {
        self.raw(dir).and_then(|r| r.chunk(chunk).map(|(f, offset)| (f.path.clone(), offset)))
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
    fn source_files_are_a_manifest_of_chunks_and_the_first_list_wins() {
        let listings = Listings::new();
        let entry =
            |path: &str, size, chunks: Vec<u32>| FileEntry { path: path.into(), size, crc32c: size as u32, chunks };
        let files = vec![
            entry("a/x.tar", 5, vec![]),
            entry("b.tar", 25, vec![1, 2, 3]),
            entry("c", 0, vec![]),
            // Chunks that do not match the size: fetched whole, checked by the whole file's CRC.
            entry("d", 15, vec![9]),
        ];
        let list = |dir: &str, files| FileList { chunk_bytes: 10, dir: dir.into(), dirs: vec![], files, next: None };
        let (id, raw) = listings.put_raw(list("", files));
        assert_eq!(id, 0);
        assert_eq!(raw.manifest.bytes, 45);
        let entries: Vec<(u64, u32)> = raw.manifest.batches.iter().map(|b| (b.bytes, b.crc32c)).collect();
        assert_eq!(entries, [(5, 5), (10, 1), (10, 2), (5, 3), (0, 0), (15, 15)]);
        assert_eq!(raw.chunks_of(1), Some(1..4));
        assert_eq!(raw.chunks_of(2), Some(4..5));
        assert_eq!(raw.chunks_of(4), None);
        assert_eq!(listings.put_raw(list("", vec![])).0, 0, "the first list of a directory wins");
        assert_eq!(listings.raw(0).unwrap().files.files.len(), 4);
        assert_eq!(listings.raw_chunk(0, 0), Some(("a/x.tar".into(), 0)));
        assert_eq!(listings.raw_chunk(0, 3), Some(("b.tar".into(), 20)));
        assert_eq!(listings.raw_chunk(0, 5), Some(("d".into(), 0)));
        assert_eq!(listings.raw_chunk(0, 6), None);
        let (sub, _) = listings.put_raw(list("a", vec![entry("a/y", 3, vec![])]));
        assert_eq!(sub, 1);
        assert_eq!(listings.raw_chunk(1, 0), Some(("a/y".into(), 0)));
        assert_eq!(listings.raw_at("a").map(|(id, _)| id), Some(1));
        assert!(listings.raw_at("b").is_none() && listings.raw(2).is_none());
    }

    /// A list whose chunk size is 0 (a server that sends nonsense) has its files fetched whole, checked by
    /// the whole file's CRC: no chunk of no bytes, and no division by it when a file is read.
    #[test]
    fn a_chunk_size_of_zero_fetches_files_whole() {
        let listings = Listings::new();
        let file = FileEntry { path: "f".into(), size: 3, crc32c: 9, chunks: vec![1, 2, 3] };
        let (_, raw) = listings.put_raw(FileList {
            chunk_bytes: 0,
            dir: String::new(),
            dirs: vec![],
            files: vec![file],
            next: None,
        });
        assert_eq!(raw.chunks_of(0), Some(0..1));
        assert_eq!(raw.manifest.batches.iter().map(|b| (b.bytes, b.crc32c)).collect::<Vec<_>>(), [(3, 9)]);
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
        let two = Listing::Epoch { epoch: 2, format: BatchFormat::Tfrecord };
        assert!(listings.start_warming(two) && !listings.start_warming(two));
        assert!(listings.start_warming(Listing::Rolling { epoch: 2 }), "another listing of the epoch");
        listings.warmed(two);
        assert!(listings.start_warming(two));
    }
}
