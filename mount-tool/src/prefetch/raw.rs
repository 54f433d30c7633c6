//! The dataset's own directories as the server lists them: each listed once (every page), when first looked
//! into (by `raw/` or `shuffled/`, which share the lists), and kept with its files cut into chunks of the
//! list's `chunk_bytes`: a file of one chunk is fetched whole like a batch, a larger one chunk by chunk,
//! each checked against its own CRC32C. What these chunks are to the prefetcher is `raw/`'s to say
//! (`fs/views/raw/chunks.rs`); the filesystem's tree of them is `fs/views/raw/tree.rs`.

use super::retry::{with_retries, Failure};
use super::{Prefetcher, ReadError};
use crate::client::Sent;
use crate::sync::{Arc, Mutex};
use crate::sync::{AtomicBool, Ordering};
use batchfs::api::{FileEntry, FileList};

/// The directories of `raw/` listed so far, by id (the order they were listed in) and by path.
#[derive(Default)]
pub(super) struct RawDirs(Mutex<Dirs>, crate::sync::Condvar);

#[derive(Default)]
struct Dirs {
    dirs: Vec<Raw>,
    by_path: std::collections::HashMap<String, u32>,
    /// Directories being listed now: another who wants one waits for that listing.
    listing: std::collections::HashSet<String>,
}

/// One directory of `raw/`: its subdirectories, its files and their chunks.
#[derive(Clone)]
pub struct Raw {
    /// Every page of the directory's list, merged (`dirs` without repeats).
    pub files: Arc<FileList>,
    /// What the server sends for each chunk: the chunks of file 0, then of file 1, and so on.
    pub chunks: Arc<[Sent]>,
    /// The bytes of all the chunks.
    pub bytes: u64,
    /// The first chunk of each file, and the number of chunks last.
    pub first_chunk: Arc<Vec<u64>>,
    /// A DALI index (`*.idx`) of this directory was read: every other one was asked for.
    indexes_warmed: Arc<AtomicBool>,
}

impl Raw {
    /// The chunks of every DALI index (`*.idx`) of the directory, the first time a read of its chunk
    /// `chunk` is one of them (DALI reads all of them, one after another, when its pipeline is built; they
    /// are small); empty otherwise.
    pub fn indexes_at(&self, chunk: u64) -> Vec<u64> {
        // Every read of raw/ asks: once done, the answer is at hand.
        if self.indexes_warmed.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let is_index = |c| self.chunk(c).is_some_and(|(f, _)| f.path.ends_with(".idx"));
        if !is_index(chunk) || self.indexes_warmed.swap(true, Ordering::Relaxed) {
            return Vec::new();
        }
        (0..self.files.files.len() as u64)
            .filter(|&f| self.files.files[f as usize].path.ends_with(".idx"))
            .filter_map(|f| self.chunks_of(f))
            .flatten()
            .filter(|&c| c != chunk)
            .collect()
    }

    /// The chunks of file `file`, if it exists.
    pub fn chunks_of(&self, file: u64) -> Option<std::ops::Range<u64>> {
        let f = file as usize;
        Some(*self.first_chunk.get(f)?..*self.first_chunk.get(f + 1)?)
    }

    /// What the server sends for file `file` whole (its size and CRC32C), as the node cache files it, if it
    /// exists.
    pub fn whole(&self, file: u64) -> Option<crate::node_cache::Key> {
        Some(crate::node_cache::Key::whole(self.files.files.get(file as usize)?))
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

impl RawDirs {
    /// Claims the listing of `path` if nobody lists it; else waits (up to `timeout`) until that listing
    /// ends and returns false (the caller looks again).
    pub fn claim(&self, path: &str, timeout: std::time::Duration) -> bool {
        let mut dirs = self.0.lock().expect("raw");
        let deadline = std::time::Instant::now() + timeout;
        while dirs.listing.contains(path) {
            let now = std::time::Instant::now();
            if now >= deadline {
                break;
            }
            dirs = self.1.wait_timeout(dirs, deadline - now).expect("raw").0;
        }
        if dirs.by_path.contains_key(path) {
            return false;
        }
        // Nobody lists it now, or its lister has taken longer than `timeout`: this caller lists it.
        dirs.listing.insert(path.to_owned());
        true
    }

    /// Claims the listing of `path` if nobody lists it (and it is not listed).
    pub fn try_claim(&self, path: &str) -> bool {
        let mut dirs = self.0.lock().expect("raw");
        !dirs.by_path.contains_key(path) && dirs.listing.insert(path.to_owned())
    }

    /// The listing of `path` ended (listed or failed).
    pub fn release(&self, path: &str) {
        self.0.lock().expect("raw").listing.remove(path);
        self.1.notify_all();
    }

    /// Directory `dir`, if listed.
    pub fn get(&self, dir: u32) -> Option<Raw> {
        self.0.lock().expect("raw").dirs.get(dir as usize).cloned()
    }

    /// The directory at `path`, if listed, and its id.
    pub fn at(&self, path: &str) -> Option<(u32, Raw)> {
        let raw = self.0.lock().expect("raw");
        raw.by_path.get(path).map(|&id| (id, raw.dirs[id as usize].clone()))
    }

    /// Keeps a directory's list (every page merged; the first list of a path wins, so every caller
    /// sees the same one) and derives its chunks, file after file in the list's order. Returns its id.
    pub fn put(&self, mut files: FileList) -> (u32, Raw) {
        let mut raw = self.0.lock().expect("raw");
        if let Some(&id) = raw.by_path.get(&files.dir) {
            return (id, raw.dirs[id as usize].clone());
        }
        let mut sent: Vec<Sent> = Vec::with_capacity(files.files.len());
        let mut first_chunk = Vec::with_capacity(files.files.len() + 1);
        for file in &mut files.files {
            first_chunk.push(sent.len() as u64);
            let chunks = chunk_crcs(file, files.chunk_bytes);
            if chunks.len() == 1 {
                // Fetched whole: the chunk list, if any, is not needed.
                file.chunks = Vec::new();
            }
            sent.extend(chunks.into_iter().map(|(bytes, crc32c)| Sent { bytes, crc32c }));
        }
        first_chunk.push(sent.len() as u64);
        let id = raw.dirs.len() as u32;
        raw.by_path.insert(files.dir.clone(), id);
        let made = Raw {
            files: Arc::new(files),
            bytes: sent.iter().map(|c| c.bytes).sum(),
            chunks: sent.into(),
            first_chunk: Arc::new(first_chunk),
            indexes_warmed: Default::default(),
        };
        raw.dirs.push(made.clone());
        (id, made)
    }
}

impl Prefetcher {
    /// Directory `path` of the dataset's files (`""`: the top): its id and its list, every page fetched
    /// once, when first asked for, with retries up to `timeout`. Blocks like [`Prefetcher::manifest`].
    pub fn list_dir(&self, path: &str) -> Result<(u32, Arc<FileList>), ReadError> {
        loop {
            if let Some((id, raw)) = self.raw.at(path) {
                return Ok((id, raw.files));
            }
            // Being listed (ahead, or by another reader): wait for that listing rather than ask again.
            if self.raw.claim(path, self.config.timeout) {
                let listed = self.runtime.block_on(self.fetch_dir(path));
                self.raw.release(path);
                return listed;
            }
        }
    }

    /// Lists directories `paths` in the background, a few at a time, those not listed yet: a walk that
    /// will look into each of them (ImageFolder's, over `shuffled/`'s class folders) then finds them
    /// listed instead of waiting a round trip for each in turn.
    pub fn list_dirs_ahead(self: &Arc<Self>, paths: Vec<String>) {
        /// Directories listed at once.
        const AT_ONCE: usize = 32;
        if paths.is_empty() {
            return;
        }
        let this = self.clone();
        self.runtime.spawn(async move {
            use futures_util::StreamExt;
            let todo = paths.into_iter().filter(|p| this.raw.at(p).is_none());
            let fetches = futures_util::stream::iter(todo.map(|p| {
                let this = this.clone();
                async move {
                    // One being listed already is left to its lister.
                    if !this.raw.try_claim(&p) {
                        return;
                    }
                    if let Err(e) = this.fetch_dir(&p).await {
                        tracing::debug!(dir = %p, error = %e, "listing ahead failed (listed when looked into)");
                    }
                    this.raw.release(&p);
                }
            }));
            fetches.buffer_unordered(AT_ONCE).collect::<Vec<()>>().await;
        });
    }

    /// Fetches directory `path`'s list, every page, with retries up to `timeout`, and keeps it (the first
    /// list of a path kept wins). A page listed from another index than the mount's fails the listing at
    /// once, and nothing of it is kept: its files are not the ones the directories listed before hold.
    async fn fetch_dir(&self, path: &str) -> Result<(u32, Arc<FileList>), ReadError> {
        let mut merged: Option<FileList> = None;
        let mut cursor = 0;
        loop {
            let (client, dir) = (self.client.clone(), path.to_owned());
            let page = with_retries(&self.config, &self.stats, move |_| {
                let (client, dir) = (client.clone(), dir.clone());
                async move { client.files(&dir, cursor).await.map_err(Failure::Client) }
            })
            .await?;
            if let Some(changed) = self.config.changed(&page.index_id, &format!("listing of directory {path:?}")) {
                return Err(changed);
            }
            let next = page.next;
            match &mut merged {
                None => merged = Some(page),
                Some(all) => {
                    for d in page.dirs {
                        // A subdirectory spanning two pages is named on both.
                        if all.dirs.last() != Some(&d) {
                            all.dirs.push(d);
                        }
                    }
                    all.files.extend(page.files);
                }
            }
            // A cursor that does not move on would never end.
            match next {
                Some(n) if n > cursor => cursor = n,
                _ => break,
            }
        }
        let (id, raw) = self.raw.put(merged.expect("one page at least"));
        Ok((id, raw.files))
    }

    /// The size of file `file` of directory `dir` of `raw/`.
    pub fn file_size(&self, dir: u32, file: u64) -> Result<u64, ReadError> {
        let raw = self.raw_dir(dir)?;
        raw.files
            .files
            .get(file as usize)
            .map(|f| f.size)
            .ok_or_else(|| ReadError::NotFound(format!("source file #{file}")))
    }

    /// Directory `dir` of `raw/`, listed before.
    pub fn raw_dir(&self, dir: u32) -> Result<Raw, ReadError> {
        self.raw.get(dir).ok_or_else(|| ReadError::NotFound(format!("raw directory #{dir}")))
    }

    /// The chunks of file `file` of directory `dir` (its position in [`Prefetcher::list_dir`]'s list):
    /// the indices of its keys in `raw/`'s listing of the directory, one for a file fetched whole.
    pub fn file_chunks(&self, dir: u32, file: u64) -> Result<std::ops::Range<u64>, ReadError> {
        self.raw_dir(dir)?.chunks_of(file).ok_or_else(|| ReadError::NotFound(format!("source file #{file}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_files_are_lists_of_chunks_and_the_first_list_wins() {
        let raw_dirs = RawDirs::default();
        let entry = |path: &str, size, chunks: Vec<u32>| FileEntry {
            path: path.into(),
            size,
            crc32c: size as u32,
            chunks,
            sample: None,
        };
        let files = vec![
            entry("a/x.tar", 5, vec![]),
            entry("b.tar", 25, vec![1, 2, 3]),
            entry("c", 0, vec![]),
            // Chunks that do not match the size: fetched whole, checked by the whole file's CRC.
            entry("d", 15, vec![9]),
        ];
        let list = |dir: &str, files| FileList {
            chunk_bytes: 10,
            dir: dir.into(),
            dirs: vec![],
            files,
            next: None,
            index_id: String::new(),
        };
        let (id, raw) = raw_dirs.put(list("", files));
        assert_eq!(id, 0);
        assert_eq!(raw.bytes, 45);
        let entries: Vec<(u64, u32)> = raw.chunks.iter().map(|c| (c.bytes, c.crc32c)).collect();
        assert_eq!(entries, [(5, 5), (10, 1), (10, 2), (5, 3), (0, 0), (15, 15)]);
        assert_eq!(raw.chunks_of(1), Some(1..4));
        assert_eq!(raw.chunks_of(2), Some(4..5));
        assert_eq!(raw.chunks_of(4), None);
        assert_eq!(raw_dirs.put(list("", vec![])).0, 0, "the first list of a directory wins");
        assert_eq!(raw_dirs.get(0).unwrap().files.files.len(), 4);
        let chunk_path =
            |dir: u32, c: u64| raw_dirs.get(dir).and_then(|r| r.chunk(c).map(|(f, offset)| (f.path.clone(), offset)));
        assert_eq!(chunk_path(0, 0), Some(("a/x.tar".into(), 0)));
        assert_eq!(chunk_path(0, 3), Some(("b.tar".into(), 20)));
        assert_eq!(chunk_path(0, 5), Some(("d".into(), 0)));
        assert_eq!(chunk_path(0, 6), None);
        let (sub, _) = raw_dirs.put(list("a", vec![entry("a/y", 3, vec![])]));
        assert_eq!(sub, 1);
        assert_eq!(chunk_path(1, 0), Some(("a/y".into(), 0)));
        assert_eq!(raw_dirs.at("a").map(|(id, _)| id), Some(1));
        assert!(raw_dirs.at("b").is_none() && raw_dirs.get(2).is_none());
    }

    /// A directory listed after the dataset was indexed again with other files (another index id than the
    /// mount's) fails at once, as no retry mends it, and is not kept: a later look finds it unlisted, not
    /// the new files. A page of the mount's index, or of a server that says none, is listed.
    #[test]
    fn a_listing_of_another_index_fails_at_once_and_is_not_kept() {
        let ids = ("0000000000000001", "0000000000000001");
        let (_runtime, client, p) = super::super::tests::of_files(&["a/x.jpg", "a/y.jpg", "b/z.jpg"], b"data", ids);
        assert_eq!(p.list_dir("a").unwrap().1.files.len(), 2, "the mount's index: listed");
        *client.index_id.lock().unwrap() = "0000000000000002".into();
        let started = std::time::Instant::now();
        let err = p.list_dir("b").unwrap_err();
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "at once, not after timeout");
        let ReadError::Changed { dataset, was, now, reply } = &err else { panic!("{err}") };
        assert_eq!((dataset.as_str(), was.as_str(), now.as_str()), ("d", "0000000000000001", "0000000000000002"));
        assert!(reply.contains("\"b\"") && err.to_string().contains("\"d\""), "{err}");
        assert!(p.raw.at("b").is_none(), "nothing of the other index kept");
        assert_eq!(p.list_dir("a").unwrap().1.files.len(), 2, "listed before: kept, still served");
        // A server that says no index id (a release before): nothing to compare.
        client.index_id.lock().unwrap().clear();
        assert_eq!(p.list_dir("b").unwrap().1.files.len(), 1);
    }

    /// A list whose chunk size is 0 (a server that sends nonsense) has its files fetched whole, checked by
    /// the whole file's CRC: no chunk of no bytes, and no division by it when a file is read.
    #[test]
    fn a_chunk_size_of_zero_fetches_files_whole() {
        let raw_dirs = RawDirs::default();
        let file = FileEntry { path: "f".into(), size: 3, crc32c: 9, chunks: vec![1, 2, 3], sample: None };
        let list = FileList {
            chunk_bytes: 0,
            dir: String::new(),
            dirs: vec![],
            files: vec![file],
            next: None,
            index_id: String::new(),
        };
        let (_, raw) = raw_dirs.put(list);
        assert_eq!(raw.chunks_of(0), Some(0..1));
        assert_eq!(raw.chunks.iter().map(|c| (c.bytes, c.crc32c)).collect::<Vec<_>>(), [(3, 9)]);
    }
}
