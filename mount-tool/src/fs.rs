//! The filesystem, without FUSE: names, inodes, attributes, directory listings and reads, driven by the
//! FUSE adapter (`fuse.rs`) and directly by tests.
//!
//! ```text
//! /                       epoch-0000 ... epoch-{epochs-1}, .batchfs
//! /epoch-NNNN/            batch-000000.tfrecord (+ batch-000000.tfrecord.idx) | batch-000000.tar
//! /.batchfs/stats         live JSON counters
//! /raw/...                the dataset directory's files as they are on the server (every source)
//! /rolling/               one epoch's names; each open of one serves the next epoch of that file
//! /shuffled/CLASS/...     a file tree's samples by class, each name a new sample of that class in plan
//!                         order, as ImageFolder's shuffled reads ask for them
//! ```
//! Each of these is a view of its own (`fs/views.rs` and `fs/views/`): the filesystem holds the root,
//! lists in it what each view puts there, and hands every other inode to the view that owns it. `stat`
//! and `readdir` use manifests (and `rolling/`'s slot table) only, never sample data. The other rooms:
//! `fs/inode.rs` (which numbers are whose), `fs/error.rs` (errors and their errnos), `fs/handles.rs` (open
//! handles) and `fs/open_files.rs` (how each open reads, passthrough).

use crate::prefetch::Prefetcher;
use bytes::Bytes;
use std::sync::Arc;
use std::time::SystemTime;

mod error;
mod failed_reads;
pub use failed_reads::REPEATED_WITHIN as FAILED_READS_REPEATED_WITHIN;
pub mod handles;
mod inode;
pub mod open_files;
mod page_drops;
pub mod views;
pub use crate::options::RollingMode;
pub use error::FsError;
pub use inode::ROOT;
pub use views::epochs::{batch_name, epoch_name};
pub use views::meta::{META_NAME, STATS_FILE};
pub use views::raw::RAW_NAME;
pub use views::rolling::ROLLING_NAME;
pub use views::shuffled::SHUFFLED_NAME;
use views::View;
pub use views::{Attr, Entry, Keep, Opening, Who};

/// Entries of a directory one `readdir` call returns at most (the kernel asks again from where it got
/// to), so listing a directory of a million files costs each entry once, not the whole directory per call.
pub const READDIR_BATCH: usize = 4096;

/// Mount-wide settings of the filesystem view.
#[derive(Debug, Clone)]
pub struct FsOptions {
    /// Epoch directories listed in the root (any epoch resolves by name).
    pub epochs: u64,
    /// `tfrecord` (with `.idx` twins) or `tar`.
    pub format: batchfs::encode::BatchFormat,
    pub uid: u32,
    pub gid: u32,
    /// Times reported for every node.
    pub time: SystemTime,
    /// Show `raw/` (the dataset's source files).
    pub raw: bool,
    /// How `rolling/` lays out TFRecord batches.
    pub rolling: RollingMode,
    /// The epoch the first open of each `rolling/` file serves.
    pub first_epoch: u64,
    /// The class folders of `shuffled/` (a file tree's first directories); none: no `shuffled/`.
    pub classes: Vec<String>,
}

/// A verified file for the kernel to serve ([`Fs::backing_file`]): a memory file, or the node cache's file
/// on a local disk (`on_disk`; a kernel may refuse a file on a stacked filesystem such as overlayfs).
pub struct Backing {
    pub file: Arc<std::fs::File>,
    pub on_disk: bool,
}

/// The filesystem.
pub struct Fs {
    prefetcher: Arc<Prefetcher>,
    pub options: FsOptions,
    views: Vec<Box<dyn View>>,
    /// Reads that just failed after waiting, answered again at once (`fs/failed_reads.rs`).
    failed_reads: failed_reads::FailedReads,
}

impl Fs {
    pub fn new(prefetcher: Arc<Prefetcher>, options: FsOptions) -> Self {
        let views = views::all(&prefetcher, &options);
        Fs { prefetcher, options, views, failed_reads: Default::default() }
    }

    /// The view that owns inode `ino`.
    fn view(&self, ino: u64) -> Result<&dyn View, FsError> {
        self.views.iter().find(|v| v.owns(ino)).map(|v| v.as_ref()).ok_or(FsError::NotFound)
    }

    /// Writes the views' state through to `ledger` (for a worker that takes over this mount), having taken
    /// what it holds (a worker before this one wrote it): `rolling/`'s counters and readers, `shuffled/`'s
    /// cursors, and `raw/`'s listings, listed again in their order before `raw/` answers.
    pub fn record_in(&mut self, ledger: Arc<crate::ledger::Ledger>) {
        for view in &mut self.views {
            view.record_in(&ledger);
        }
    }

    /// Process `owner` has handle of `ino` open, opened under a worker before this one: held again as the
    /// open held it (a `rolling/` packed file is found by name by its process until released).
    pub fn adopted(&self, ino: u64, owner: u32) {
        if let Ok(view) = self.view(ino) {
            view.adopted(ino, owner);
        }
    }

    /// The parent directory of directory `ino` (the root is its own).
    pub fn parent(&self, ino: u64) -> u64 {
        match self.view(ino) {
            Ok(view) if ino != ROOT => view.parent(ino),
            _ => ROOT,
        }
    }

    pub fn stats(&self) -> &crate::stats::Stats {
        &self.prefetcher.stats
    }

    /// The counters, for a thread that outlives the request (`page_drops.rs`).
    pub fn shared_stats(&self) -> Arc<crate::stats::Stats> {
        self.prefetcher.stats.clone()
    }

    /// Whether files are handed to the kernel (FUSE passthrough): bodies are then fetched straight into
    /// memory files, and `batchfs stats` says so.
    /// The kernel refused a file of the node cache's disk as a backing file.
    pub fn refuse_disk(&self) {
        self.prefetcher.refuse_disk();
    }

    pub fn set_passthrough(&self, on: bool) {
        self.prefetcher.fetch_into_memfds(on);
        self.prefetcher.stats.passthrough.store(u64::from(on), std::sync::atomic::Ordering::Relaxed);
    }

    pub fn stats_json(&self) -> Vec<u8> {
        views::meta::stats_json(&self.prefetcher)
    }

    /// Resolves `name` in directory `parent` for process `owner` (0: unknown; in `rolling/` the layout
    /// depends on the reader).
    pub fn lookup(&self, parent: u64, name: &str, owner: u32) -> Result<Attr, FsError> {
        self.lookup_as(parent, name, owner, owner)
    }

    /// [`Fs::lookup`] by thread `tid` of process `owner` (a name of `shuffled/` hands its thread a sample).
    pub fn lookup_as(&self, parent: u64, name: &str, owner: u32, tid: u32) -> Result<Attr, FsError> {
        crate::stats::Stats::add(&self.stats().lookups, 1);
        let ino = if parent == ROOT {
            self.views.iter().find_map(|v| v.root_lookup(name)).ok_or(FsError::NotFound)?
        } else {
            self.view(parent)?.lookup(parent, name, Who { owner, tid })?
        };
        self.getattr(ino)
    }

    /// Attributes of inode `ino`.
    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        if ino == ROOT {
            return Ok(Attr::dir(ROOT));
        }
        self.view(ino)?.attr(ino)
    }

    /// Whether a listing may carry `ino`'s entry and attributes (`READDIRPLUS`): not a name looked up
    /// anew at every use (`shuffled/`'s, `rolling/`'s, the stats'), nor one whose attributes cost work
    /// (the indexed layout's twins).
    pub fn listed_whole(&self, ino: u64) -> bool {
        ino == ROOT || self.view(ino).is_ok_and(|v| v.listed_whole(ino))
    }

    /// The attributes a listing carries for `ino`, if it is listed whole ([`Fs::listed_whole`]), asking
    /// the view that owns it once.
    pub fn listed_attr(&self, ino: u64) -> Option<Attr> {
        if ino == ROOT {
            return Some(Attr::dir(ROOT));
        }
        let view = self.view(ino).ok()?;
        view.listed_whole(ino).then(|| view.attr(ino).ok()).flatten()
    }

    /// The entries of directory `ino` (without `.` and `..`) as process `owner` sees them.
    pub fn readdir(&self, ino: u64, owner: u32) -> Result<Vec<Entry>, FsError> {
        self.entries(ino, 0, usize::MAX, owner)
    }

    /// At most `max` entries of directory `ino` from position `from` (without `.` and `..`).
    fn entries(&self, ino: u64, from: usize, max: usize, owner: u32) -> Result<Vec<Entry>, FsError> {
        if ino == ROOT {
            // Each view's entries in turn, made only from the page's first on.
            let (mut out, mut from) = (Vec::new(), from);
            for view in &self.views {
                if out.len() >= max {
                    break;
                }
                let n = view.root_len();
                if from >= n {
                    from -= n;
                    continue;
                }
                out.extend(view.root_page(from, max - out.len()));
                from = 0;
            }
            return Ok(out);
        }
        self.view(ino)?.entries(ino, from, max, owner)
    }

    /// Every entry of directory `ino` as `readdir` returns it: `.`, `..`, then [`Fs::readdir`]'s, each as
    /// (inode, is a directory, name).
    pub fn dir_entries(&self, ino: u64, owner: u32) -> Result<Vec<(u64, bool, String)>, FsError> {
        self.dir_entries_from(ino, 0, owner)
    }

    /// [`Fs::dir_entries`] from position `offset` on, at most [`READDIR_BATCH`] of them a call.
    pub fn dir_entries_from(&self, ino: u64, offset: usize, owner: u32) -> Result<Vec<(u64, bool, String)>, FsError> {
        let entries = self.entries(ino, offset.saturating_sub(2), READDIR_BATCH, owner)?;
        let dots = [(ino, true, ".".to_owned()), (self.parent(ino), true, "..".to_owned())];
        let mut out: Vec<(u64, bool, String)> = dots.into_iter().skip(offset).collect();
        out.extend(entries.into_iter().map(|e| (e.ino, e.dir, e.name)));
        Ok(out)
    }

    /// Checks that `ino` can be opened for reading, and how it opens. [`Fs::opened`] says when the open got
    /// its file.
    pub fn open(&self, ino: u64, write: bool) -> Result<Opening, FsError> {
        if ino == ROOT {
            return if write { Err(FsError::ReadOnly) } else { Ok(Opening::File) };
        }
        let view = self.view(ino)?;
        if write {
            return Err(FsError::ReadOnly);
        }
        view.open(ino)
    }

    /// An open of `ino` by process `owner` succeeded. An open of a `rolling/` file moves its name on (its
    /// next lookup, the next open's, is the following epoch's file); an open of a twin there makes
    /// `owner` an index-driven reader (with `rolling=auto`). A failed open moves nothing.
    pub fn opened(&self, ino: u64, owner: u32) {
        self.opened_as(ino, owner, owner)
    }

    /// [`Fs::opened`] by thread `tid` of process `owner`: a sample of `shuffled/` is the thread's file now.
    pub fn opened_as(&self, ino: u64, owner: u32, tid: u32) {
        if let Ok(view) = self.view(ino) {
            view.opened(ino, Who { owner, tid });
        }
    }

    /// Process `owner` released a handle of `ino` that [`Fs::opened`] counted.
    pub fn released(&self, ino: u64, owner: u32) {
        if let Ok(view) = self.view(ino) {
            view.released(ino, owner);
        }
    }

    /// Reads `size` bytes at `offset` of file `ino` for the reading process `owner`.
    pub fn read(&self, ino: u64, offset: u64, size: u32, owner: u32) -> Result<Bytes, FsError> {
        self.read_as(ino, offset, size, owner, owner)
    }

    /// [`Fs::read`] by thread `tid` of process `owner`. A read of the file that failed after waiting out
    /// `timeout` a moment ago fails again at once, without a second wait (`fs/failed_reads.rs`: Linux
    /// repeats a failed readahead's read).
    pub fn read_as(&self, ino: u64, offset: u64, size: u32, owner: u32, tid: u32) -> Result<Bytes, FsError> {
        if ino == ROOT {
            return Err(FsError::IsADirectory);
        }
        let view = self.view(ino)?;
        let read = match self.failed_reads.repeat(ino, tid, std::time::Instant::now()) {
            Some(e) => Err(e),
            None => {
                let read = view.read(ino, offset, size, owner);
                self.failed_reads.record(ino, tid, &read, std::time::Instant::now());
                read
            }
        };
        // Its bytes did not come within `timeout` (the server down): the view may give the file's contents
        // back to be served again (a `shuffled/` sample, a `rolling/` name's epoch). A repeated failure
        // counts too: it never reaches the view.
        if let Err(FsError::Io(crate::prefetch::ReadError::Timeout { .. })) = &read {
            view.read_failed(ino);
        }
        read
    }

    /// The verified contents of file `ino` for the kernel to serve (FUSE passthrough): with `disk`, a
    /// `raw/` file the node cache holds, its file there (checked, never copied into memory); else a sealed
    /// memory file, waited for like a read by `owner` does. `None` for a file read through the daemon: a
    /// source file of more than one chunk (read chunk by chunk, never held whole), a sample of `shuffled/`
    /// (part of its group, and a memory file of its own per open cost more than the reads it saves).
    pub fn backing_file(&self, ino: u64, owner: u32, disk: bool) -> Result<Option<Backing>, FsError> {
        if ino == ROOT {
            return Err(FsError::IsADirectory);
        }
        self.view(ino)?.backing(ino, owner, disk)
    }

    /// The last handle of file `ino` was closed.
    pub fn closed(&self, ino: u64) {
        if let Ok(view) = self.view(ino) {
            view.closed(ino);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::views::rolling::RollingFile;
    use super::views::{epochs, raw, rolling, shuffled};
    use super::*;
    use crate::client::MemoryClient;
    use crate::prefetch::PrefetcherConfig;
    use batchfs::encode::BatchFormat;
    use proptest::prelude::*;

    /// The source files of the test dataset; each holds `contents of {path}`.
    const RAW_FILES: [&str; 5] = ["a/x.jpg", "a/y.jpg", "b/c/z.jpg", "s", "top.txt"];

    fn fs(format: BatchFormat) -> (tokio::runtime::Runtime, Fs) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|epoch, f| {
            (0..3).map(|b| Bytes::from(format!("{f} epoch {epoch} batch {b}").into_bytes())).collect()
        });
        client.files =
            RAW_FILES.iter().map(|p| (p.to_string(), Bytes::from(format!("contents of {p}").into_bytes()))).collect();
        // Small chunks: every file but `s` is fetched in two ranges, and reads cross chunks.
        client.chunk_bytes = 16;
        let p = Prefetcher::new(Arc::new(client), rt.handle().clone(), PrefetcherConfig::default());
        (rt, Fs::new(p, options(format)))
    }

    fn options(format: BatchFormat) -> FsOptions {
        FsOptions {
            epochs: 2,
            format,
            uid: 0,
            gid: 0,
            time: SystemTime::UNIX_EPOCH,
            raw: true,
            rolling: RollingMode::Packed,
            first_epoch: 0,
            classes: vec![],
        }
    }

    /// A class-folder tree of `per_class[c]` files in class `c` (`c0/f000.jpg`...), each holding its own
    /// path, as a mount of `share` sees it through `shuffled/`.
    fn class_tree(per_class: &[usize], share: (u32, u32)) -> (tokio::runtime::Runtime, Fs, Vec<(String, Bytes)>) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|_, _| vec![]);
        for (c, &n) in per_class.iter().enumerate() {
            for i in 0..n {
                let path = format!("c{c}/f{i:03}.jpg");
                let body = format!("{path}:{}", "x".repeat(i * 37 % 200));
                client.files.push((path, Bytes::from(body.into_bytes())));
            }
        }
        let files = client.files.clone();
        let classes: Vec<String> = (0..per_class.len()).map(|c| format!("c{c}")).collect();
        let mut config = PrefetcherConfig::default();
        config.shuffled.share = share;
        let p = Prefetcher::new(Arc::new(client), rt.handle().clone(), config);
        (rt, Fs::new(p, FsOptions { classes, epochs: 3, ..options(BatchFormat::Tfrecord) }), files)
    }

    /// Every name of every class opened once by one of four threads, in a random order: the bytes of each
    /// class's files, each exactly once per epoch, in a new order each epoch; `stat` says each one's size.
    #[test]
    fn each_open_in_shuffled_gets_the_next_sample_of_its_class_once_an_epoch() {
        let (_rt, fs, files) = class_tree(&[5, 9, 1], (0, 1));
        let root: Vec<String> = fs.readdir(ROOT, 0).unwrap().into_iter().map(|e| e.name).collect();
        assert!(root.contains(&"shuffled".to_owned()), "{root:?}");
        let dir = fs.lookup(ROOT, "shuffled", 0).unwrap().ino;
        let classes: Vec<String> = fs.readdir(dir, 0).unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(classes, ["c0", "c1", "c2"]);
        let mut orders = Vec::new();
        for epoch in 0..2 {
            let mut got: Vec<(usize, Vec<u8>)> = Vec::new();
            let mut names = Vec::new();
            for (c, class) in classes.iter().enumerate() {
                let class_ino = fs.lookup(dir, class, 0).unwrap().ino;
                let listed = fs.dir_entries(class_ino, 0).unwrap();
                names.extend(listed[2..].iter().map(|e| (c, class_ino, e.2.clone())));
            }
            // A shuffled walk, as a sampler's: four threads taking turns.
            let mut rng = batchfs::plan::SplitMix64::new(epoch);
            for i in (1..names.len()).rev() {
                names.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            for (i, (c, class_ino, name)) in names.iter().enumerate() {
                let tid = 100 + (i % 4) as u32;
                let attr = fs.lookup_as(*class_ino, name, 7, tid).unwrap();
                assert_eq!(fs.lookup_as(*class_ino, name, 7, tid).unwrap(), attr, "looked up again: the same");
                fs.opened_as(attr.ino, 7, tid);
                let body = fs.read(attr.ino, 0, 1 << 20, 7).unwrap();
                assert_eq!(body.len() as u64, attr.size);
                got.push((*c, body.to_vec()));
            }
            // Every group of the epoch read whole has left the memory cache at once.
            let groups: usize =
                fs.prefetcher.class_plan(epoch, classes.len()).unwrap().groups.iter().map(Vec::len).sum();
            let evicted = fs.prefetcher.stats.snapshot().evictions;
            assert!(evicted >= (groups * (epoch as usize + 1)) as u64, "{evicted} evicted of {groups} groups an epoch");
            for (c, _) in classes.iter().enumerate() {
                let mut mine: Vec<&[u8]> = got.iter().filter(|g| g.0 == c).map(|g| &g.1[..]).collect();
                let mut want: Vec<&[u8]> =
                    files.iter().filter(|f| f.0.starts_with(&format!("c{c}/"))).map(|f| &f.1[..]).collect();
                orders.push(mine.iter().map(|b| b.to_vec()).collect::<Vec<_>>());
                mine.sort();
                want.sort();
                assert_eq!(mine, want, "class {c}, epoch {epoch}: each of its samples once");
            }
        }
        assert_ne!(orders[1], orders[4], "class 1's order differs between epochs");
        assert_eq!(fs.lookup(dir, "c9", 0).unwrap_err().errno(), libc::ENOENT);
        let c0 = fs.lookup(dir, "c0", 0).unwrap().ino;
        assert_eq!(fs.lookup(c0, "nope.jpg", 0).unwrap_err().errno(), libc::ENOENT);
    }

    /// Over a slow link (30 ms a response) with the windows at their least (a sample a group), one reader's
    /// reads catch up with its class's window: the windows double where such a read waits past the first
    /// window, and every sample is still read once, right.
    #[test]
    fn shuffled_windows_grow_where_reads_catch_up_with_them() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|_, _| vec![]);
        let files: Vec<(String, Bytes)> =
            (0..12).map(|i| (format!("c0/f{i:03}.jpg"), Bytes::from(format!("sample {i}").into_bytes()))).collect();
        client.files = files.clone();
        *client.delay.lock().unwrap() = std::time::Duration::from_millis(30);
        // Samples of 8-9 bytes: 60 bytes of windows make groups of one sample that may grow to 7.
        let config = PrefetcherConfig { prefetch_bytes: 60, ..PrefetcherConfig::default() };
        let p = Prefetcher::new(Arc::new(client), rt.handle().clone(), config);
        let fs = Fs::new(p, FsOptions { classes: vec!["c0".into()], ..options(BatchFormat::Tfrecord) });
        let stats = || fs.prefetcher.stats.snapshot();
        assert_eq!(stats().shuffled_window, crate::prefetch::WINDOW_GROUPS);
        let dir = fs.lookup(ROOT, "shuffled", 0).unwrap().ino;
        let class = fs.lookup(dir, "c0", 0).unwrap().ino;
        let mut got: Vec<Vec<u8>> = Vec::new();
        for (name, _) in &files {
            let attr = fs.lookup_as(class, name.strip_prefix("c0/").unwrap(), 7, 100).unwrap();
            fs.opened_as(attr.ino, 7, 100);
            got.push(fs.read(attr.ino, 0, 1 << 20, 7).unwrap().to_vec());
        }
        assert!(stats().shuffled_window > crate::prefetch::WINDOW_GROUPS, "{:?}", stats());
        assert!(stats().shuffled_window <= crate::prefetch::WINDOW_GROUPS * crate::prefetch::WINDOW_GROWTH);
        got.sort();
        let mut want: Vec<Vec<u8>> = files.iter().map(|f| f.1.to_vec()).collect();
        want.sort();
        assert_eq!(got, want, "each sample once");
    }

    /// Two mounts of shares 0/2 and 1/2: each shows half of each class's names and serves half of its
    /// samples; together every sample once.
    #[test]
    fn shares_of_shuffled_split_every_class() {
        let mut all: Vec<Vec<u8>> = Vec::new();
        let mut files = Vec::new();
        for rank in 0..2 {
            let (_rt, fs, f) = class_tree(&[7, 4], (rank, 2));
            files = f;
            let dir = fs.lookup(ROOT, "shuffled", 0).unwrap().ino;
            for class in ["c0", "c1"] {
                let class_ino = fs.lookup(dir, class, 0).unwrap().ino;
                let names: Vec<String> =
                    fs.dir_entries(class_ino, 0).unwrap()[2..].iter().map(|e| e.2.clone()).collect();
                let total = if class == "c0" { 7 } else { 4 };
                assert_eq!(names.len(), (total + 1 - rank as usize) / 2, "{class} of rank {rank}");
                for name in names {
                    let attr = fs.lookup_as(class_ino, &name, 1, 1).unwrap();
                    fs.opened_as(attr.ino, 1, 1);
                    all.push(fs.read(attr.ino, 0, 1 << 20, 1).unwrap().to_vec());
                }
            }
        }
        let mut want: Vec<Vec<u8>> = files.iter().map(|f| f.1.to_vec()).collect();
        all.sort();
        want.sort();
        assert_eq!(all, want);
    }

    /// A job restarted after four epochs (`first_epoch=4`) finds its three epochs listed.
    #[test]
    fn the_root_lists_the_epochs_up_to_the_job_s_last() {
        let (_rt, fs) = fs(BatchFormat::Tfrecord);
        let fs =
            Fs::new(fs.prefetcher.clone(), FsOptions { first_epoch: 4, epochs: 3, ..options(BatchFormat::Tfrecord) });
        let names: Vec<String> = fs.readdir(ROOT, 0).unwrap().into_iter().map(|e| e.name).collect();
        let epochs: Vec<&String> = names.iter().filter(|n| n.starts_with("epoch-")).collect();
        assert_eq!(epochs.len(), 7, "{names:?}");
        assert_eq!((epochs[0].as_str(), epochs[6].as_str()), ("epoch-0000", "epoch-0006"));
    }

    #[test]
    fn tree_and_reads() {
        let (_rt, fs) = fs(BatchFormat::Tfrecord);
        let names: Vec<String> = fs.readdir(ROOT, 0).unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, [".batchfs", "raw", "rolling", "epoch-0000", "epoch-0001"]);
        let e7 = fs.lookup(ROOT, "epoch-0007", 0).unwrap();
        assert_eq!(e7.ino, epochs::Node::Dir(7).ino(), "unlisted epochs resolve by name");
        let listing: Vec<String> = fs.readdir(e7.ino, 0).unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(listing[..2], ["batch-000000.tfrecord", "batch-000000.tfrecord.idx"]);
        let f = fs.lookup(e7.ino, "batch-000002.tfrecord", 0).unwrap();
        let want = "tfrecord epoch 7 batch 2";
        assert_eq!(f.size, want.len() as u64);
        assert_eq!(fs.read(f.ino, 0, 100, 1).unwrap(), want.as_bytes());
        let idx = fs.lookup(e7.ino, "batch-000002.tfrecord.idx", 0).unwrap();
        assert_eq!(fs.read(idx.ino, 0, 100, 1).unwrap(), "tfrecord.idx epoch 7 batch 2".as_bytes());
        assert_eq!(fs.lookup(views::meta::META_DIR, "stats", 0).unwrap().ino, STATS_FILE);
        let json: serde_json::Value = serde_json::from_slice(&fs.stats_json()).unwrap();
        assert_eq!(json["reads"], 2);
    }

    /// The root read page by page is the root read whole, every view's entries in turn, and a page deep in
    /// a million epoch folders holds just its own.
    #[test]
    fn the_root_is_listed_page_by_page_in_the_views_order() {
        let (_rt, fs) = fs(BatchFormat::Tfrecord);
        let whole = fs.dir_entries(ROOT, 0).unwrap();
        let paged: Vec<_> =
            (0..whole.len()).flat_map(|at| fs.dir_entries_from(ROOT, at, 0).unwrap().into_iter().take(1)).collect();
        assert_eq!(paged, whole);
        let many = Fs::new(fs.prefetcher.clone(), FsOptions { epochs: 1_000_000, ..fs.options.clone() });
        let names =
            |at| -> Vec<String> { many.dir_entries_from(ROOT, at, 0).unwrap().into_iter().map(|e| e.2).collect() };
        // `.` and `..`, then .batchfs, raw and rolling: epoch N is at position N + 5.
        assert_eq!(names(999_998 + 5), ["epoch-999998", "epoch-999999"]);
        assert_eq!(names(4)[..3], ["rolling", "epoch-0000", "epoch-0001"]);
        assert_eq!(names(4).len(), READDIR_BATCH);
        assert!(names(1_000_000 + 5).is_empty());
    }

    /// What the kernel may keep is each view's to say: a name of `shuffled/` or `rolling/` leads elsewhere
    /// at its next lookup (its attributes stand), the stats are made at each open, the rest never change;
    /// and only what is kept whole is listed whole (`READDIRPLUS`), the indexed layout's twins excepted.
    #[test]
    fn names_handed_out_anew_keep_only_their_attributes() {
        let (_rt, tree, _) = class_tree(&[3], (0, 1));
        let class = tree.lookup(tree.lookup(ROOT, "shuffled", 0).unwrap().ino, "c0", 0).unwrap();
        let sample = tree.lookup_as(class.ino, "f000.jpg", 1, 1).unwrap();
        let stats = tree.lookup(tree.lookup(ROOT, ".batchfs", 0).unwrap().ino, "stats", 0).unwrap();
        assert_eq!((sample.keep, class.keep, stats.keep), (Keep::Attributes, Keep::All, Keep::Nothing));
        assert_eq!(tree.open(stats.ino, false), Ok(Opening::Snapshot));
        assert_eq!(tree.open(sample.ino, false), Ok(Opening::File));
        assert!(!tree.listed_whole(sample.ino) && !tree.listed_whole(stats.ino) && tree.listed_whole(class.ino));
        let (_rt, fs) = fs(BatchFormat::Tfrecord);
        let dir = fs.lookup(ROOT, "rolling", 0).unwrap().ino;
        let file = fs.lookup(dir, "batch-000000.tfrecord", 0).unwrap();
        assert_eq!(file.keep, Keep::Attributes);
        assert!(!fs.listed_whole(file.ino));
        assert!(!fs.listed_whole(rolling::Node::Twin { batch: 0 }.ino()));
        let batch = fs.lookup(epochs::Node::Dir(0).ino(), "batch-000000.tfrecord", 0).unwrap();
        assert_eq!(batch.keep, Keep::All);
        assert!(fs.listed_whole(batch.ino) && fs.listed_whole(dir) && fs.listed_whole(ROOT));
        for ino in [file.ino, batch.ino, dir, ROOT] {
            assert_eq!(fs.listed_attr(ino), fs.listed_whole(ino).then(|| fs.getattr(ino).unwrap()), "{ino}");
        }
    }

    #[test]
    fn each_open_of_a_rolling_name_serves_the_next_epoch_of_that_file() {
        let (rt, mut fs) = fs(BatchFormat::Tfrecord);
        fs.options.first_epoch = 5;
        fs.options.epochs = 4;
        // The epochs it serves are the span's: 5 to 8, then 5 again.
        let fs = Fs::new(fs.prefetcher.clone(), fs.options.clone());
        let _rt = rt;
        let rolling = fs.lookup(ROOT, "rolling", 0).unwrap().ino;
        assert_eq!(rolling, rolling::ROLLING_DIR);
        let names: Vec<String> = fs.readdir(rolling, 0).unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names[..2], ["batch-000000.tfrecord", "batch-000000.tfrecord.idx"]);
        assert_eq!(names.len(), 6);
        let open = |name: &str| {
            let attr = fs.lookup(rolling, name, 0).unwrap();
            fs.open(attr.ino, false).unwrap();
            fs.opened(attr.ino, 0);
            let body = fs.read(attr.ino, 0, 100, 1).unwrap();
            fs.closed(attr.ino);
            assert_eq!(attr.size, body.len() as u64);
            String::from_utf8(body.to_vec()).unwrap()
        };
        // Looking a name up (stat, ls) moves nothing; each open that got its file does, per name.
        fs.lookup(rolling, "batch-000001.tfrecord", 0).unwrap();
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord epoch 5 batch 1");
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord epoch 6 batch 1");
        assert_eq!(open("batch-000002.tfrecord"), "tfrecord epoch 5 batch 2");
        assert_eq!(open("batch-000001.tfrecord.idx"), "tfrecord.idx epoch 5 batch 1");
        let failed = fs.lookup(rolling, "batch-000001.tfrecord", 0).unwrap();
        fs.open(failed.ino, false).unwrap();
        // (No `opened`: the open failed, as a passthrough open whose fetch fails does.)
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord epoch 7 batch 1", "a failed open skips nothing");
        // readdir names each file at the epoch its next open gets.
        let listed = fs.readdir(rolling, 0).unwrap();
        let epoch_of = |name: &str| match rolling::Node::from_ino(listed.iter().find(|e| e.name == name).unwrap().ino) {
            Some(rolling::Node::File { epoch, .. }) => epoch,
            other => panic!("{other:?}"),
        };
        assert_eq!((epoch_of("batch-000001.tfrecord"), epoch_of("batch-000000.tfrecord")), (8, 5));
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord epoch 8 batch 1");
        assert_eq!(open("batch-000001.tfrecord"), "tfrecord epoch 5 batch 1", "the span's first epoch again");
        // Two opens of one looked-up file (two readers that resolved it together) share its epoch.
        let attr = fs.lookup(rolling, "batch-000000.tfrecord", 0).unwrap();
        for _ in 0..2 {
            fs.open(attr.ino, false).unwrap();
            fs.opened(attr.ino, 0);
        }
        assert_eq!(open("batch-000000.tfrecord"), "tfrecord epoch 6 batch 0");
        assert_eq!(fs.lookup(rolling, "batch-000003.tfrecord", 0).unwrap_err().errno(), libc::ENOENT);
        assert_eq!(fs.parent(rolling), ROOT);
    }

    /// The TFRecord frame of record `r` of batch `b` of epoch `e`: sizes differ between epochs, with a
    /// heavy tail (one record in seven twenty times the others).
    fn frame(e: u64, b: u64, r: u64) -> Vec<u8> {
        let len = 200 + ((e * 31 + b * 17 + r * 7) % 13) * 50 + if (e + b + r).is_multiple_of(7) { 5000 } else { 0 };
        let mut out = Vec::new();
        batchfs::tfrecord::encode_record(&vec![(e * 100 + b * 10 + r) as u8; len as usize], &mut out);
        out
    }

    /// rolling/ in the indexed layout: each name is one file whose size and twin hold for every epoch of
    /// the span; each epoch's file holds exactly that epoch's records, each at the offset its twin gives
    /// (at most its slot long), zeros between them, which a memory file for the kernel does not store.
    #[test]
    fn indexed_rolling_files_hold_each_epochs_records_at_the_twins_offsets() {
        for memfds in [false, true] {
            indexed_rolling_files_hold_each_epochs_records(memfds);
        }
    }

    /// The test above, with bodies fetched into buffers or (passthrough) placed into memory files.
    fn indexed_rolling_files_hold_each_epochs_records(memfds: bool) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let records = |e: u64, b: u64| (0..5).map(|r| frame(e, b, r)).collect::<Vec<_>>();
        let client = MemoryClient::new(move |e, f| {
            (0..3)
                .map(|b| match f {
                    BatchFormat::Tfrecord => Bytes::from(records(e, b).concat()),
                    _ => Bytes::from(format!("{f} epoch {e} batch {b}").into_bytes()),
                })
                .collect()
        });
        let config = PrefetcherConfig { rolling: (4, 3), last_epoch: 6, ..PrefetcherConfig::default() };
        let p = Prefetcher::new(Arc::new(client), rt.handle().clone(), config);
        p.fetch_into_memfds(memfds);
        let o =
            FsOptions { rolling: RollingMode::Indexed, first_epoch: 4, epochs: 3, ..options(BatchFormat::Tfrecord) };
        let fs = Fs::new(p.clone(), o);
        let rolling = fs.lookup(ROOT, "rolling", 0).unwrap().ino;
        let twin_of = |b: u64| {
            let twin = fs.lookup(rolling, &format!("batch-{b:06}.tfrecord.idx"), 0).unwrap();
            assert_eq!(twin.ino, rolling::Node::Twin { batch: b }.ino());
            let text = fs.read(twin.ino, 0, 1 << 20, 1).unwrap();
            assert_eq!(text.len() as u64, twin.size);
            let lines = String::from_utf8(text.to_vec()).unwrap();
            lines
                .lines()
                .map(|l| l.split_once(' ').map(|(o, s)| (o.parse().unwrap(), s.parse().unwrap())).unwrap())
                .collect::<Vec<(u64, u64)>>()
        };
        let twins: Vec<Vec<(u64, u64)>> = (0..3).map(twin_of).collect();
        // Four passes: epochs 4, 5, 6, then 4 again.
        for (pass, epoch) in [4, 5, 6, 4].into_iter().enumerate() {
            for b in 0..3u64 {
                let attr = fs.lookup(rolling, &format!("batch-{b:06}.tfrecord"), 0).unwrap();
                assert_eq!(
                    attr.ino,
                    rolling::Node::File { epoch, batch: b, file: RollingFile::Indexed }.ino(),
                    "pass {pass}"
                );
                let (last_offset, last_slot) = *twins[b as usize].last().unwrap();
                assert_eq!(attr.size, last_offset + last_slot, "one size for every epoch");
                fs.open(attr.ino, false).unwrap();
                fs.opened(attr.ino, 0);
                let file = fs.read(attr.ino, 0, 1 << 20, 1).unwrap();
                assert_eq!(file.len() as u64, attr.size);
                let mut found = Vec::new();
                let mut zeros = file.to_vec();
                for &(offset, slot) in &twins[b as usize] {
                    let at = offset as usize;
                    let len = u64::from_le_bytes(file[at..at + 8].try_into().unwrap()) as usize + 16;
                    assert!(len as u64 <= slot, "a record within its slot");
                    found.push(file[at..at + len].to_vec());
                    zeros[at..at + len].fill(0);
                }
                assert!(zeros.iter().all(|&z| z == 0), "zeros between the records");
                let mut want = records(epoch, b);
                want.sort();
                found.sort();
                assert_eq!(found, want, "epoch {epoch} batch {b}: exactly its records");
                // Reads across records and holes, and the memory file the kernel would serve.
                assert_eq!(fs.read(attr.ino, 100, 9000, 1).unwrap(), file.slice(100..(9100).min(file.len())));
                use std::os::unix::fs::{FileExt, MetadataExt};
                let backing = fs.backing_file(attr.ino, 1, true).unwrap().unwrap().file;
                let mut in_file = vec![7u8; file.len()];
                backing.read_exact_at(&mut in_file, 0).unwrap();
                assert!(in_file == file, "the memory file holds the same bytes");
                let stored = backing.metadata().unwrap().blocks() * 512;
                let real: u64 = want.iter().map(|r| r.len() as u64).sum();
                assert!(stored <= real.next_multiple_of(4096) + 2 * 4096 * 5, "holes: {stored} bytes for {real}");
                fs.closed(attr.ino);
            }
        }
        assert_eq!(twins, (0..3).map(twin_of).collect::<Vec<_>>(), "the twins are the same every epoch");
        // What the cache is charged for a placed file: its records, and the two pages each shares with the
        // holes around it; never the holes.
        let charged = p.cache_used();
        let placed: u64 = (4..7)
            .flat_map(|e| (0..3).map(move |b| (e, b)))
            .map(|(e, b)| records(e, b).concat().len() as u64 + 2 * 4096 * 5)
            .sum();
        assert!(charged <= placed, "{charged} charged for {placed}");
        let s = p.stats.snapshot();
        assert_eq!((s.checksum_errors, s.errors), (0, 0), "{s:?}");
        assert!(!memfds || s.passthrough_bytes > 0, "placed into memory files as they came: {s:?}");
    }

    /// `raw/` lists a directory when a lookup or a listing first looks into it, every page of it, and
    /// no other; a large directory is read back in `readdir` calls of at most [`READDIR_BATCH`].
    #[test]
    fn raw_directories_are_listed_when_first_looked_into() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|_, _| vec![]);
        client.files = (0..10_000).map(|i| (format!("big/f{i:05}"), Bytes::from_static(b"x"))).collect();
        client.files.push(("other/y".into(), Bytes::from_static(b"y")));
        client.page = 3000;
        let client = Arc::new(client);
        let p = Prefetcher::new(client.clone(), rt.handle().clone(), PrefetcherConfig::default());
        let fs = Fs::new(p, options(BatchFormat::Tfrecord));
        let raw = fs.lookup(ROOT, "raw", 0).unwrap().ino;
        assert!(client.listed.lock().unwrap().is_empty(), "nothing is listed before it is looked into");
        let big = fs.lookup(raw, "big", 0).unwrap().ino;
        let f = fs.lookup(big, "f04321", 0).unwrap();
        assert_eq!(fs.read(f.ino, 0, 10, 1).unwrap(), Bytes::from_static(b"x"));
        let listed: Vec<String> = client.listed.lock().unwrap().iter().map(|(d, _)| d.clone()).collect();
        assert!(listed.iter().all(|d| d.is_empty() || d == "big"), "{listed:?}");
        assert_eq!(listed.iter().filter(|d| *d == "big").count(), 4, "four pages of 3,000: {listed:?}");
        // readdir from each offset the kernel asks for: every entry once, in calls of at most a batch.
        let mut names = Vec::new();
        let mut offset = 0;
        loop {
            let got = fs.dir_entries_from(big, offset, 0).unwrap();
            if got.is_empty() {
                break;
            }
            assert!(got.len() <= READDIR_BATCH + 2);
            offset += got.len();
            names.extend(got.into_iter().map(|e| e.2));
        }
        assert_eq!(names.len(), 10_002);
        assert_eq!(
            (&names[..3], names.last().unwrap().as_str()),
            (&[".".into(), "..".into(), "f00000".into()][..], "f09999")
        );
        assert_eq!(fs.parent(big), raw);
        assert!(!client.listed.lock().unwrap().iter().any(|(d, _)| d == "other"), "never looked into");
    }

    /// A walk into a second subdirectory of a directory lists the others ahead (once each, even when the
    /// walk gets to one while it is being listed).
    #[test]
    fn a_walk_lists_the_next_directories_ahead() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|_, _| vec![]);
        client.files = (0..20).map(|d| (format!("c{d:02}/f.jpg"), Bytes::from_static(b"x"))).collect();
        let client = Arc::new(client);
        let p = Prefetcher::new(client.clone(), rt.handle().clone(), PrefetcherConfig::default());
        let fs = Fs::new(p, options(BatchFormat::Tfrecord));
        let raw = fs.lookup(ROOT, "raw", 0).unwrap().ino;
        let pages = || client.listed.lock().unwrap().clone();
        let listed = || {
            let mut dirs: Vec<String> = pages().into_iter().map(|(d, _)| d).collect();
            dirs.dedup();
            dirs
        };
        for (i, dir) in ["c00", "c01"].iter().enumerate() {
            let node = fs.lookup(raw, dir, 0).unwrap().ino;
            fs.readdir(node, 0).unwrap();
            if i == 0 {
                std::thread::sleep(std::time::Duration::from_millis(50));
                assert_eq!(listed(), ["", "c00"], "one look lists nothing more");
            }
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while listed().len() < 21 {
            assert!(std::time::Instant::now() < deadline, "{:?}", listed());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        for d in 2..20 {
            let node = fs.lookup(raw, &format!("c{d:02}"), 0).unwrap().ino;
            assert_eq!(fs.readdir(node, 0).unwrap().len(), 1);
        }
        let mut all = pages();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), pages().len(), "each page of each directory asked for once: {:?}", pages());
    }

    /// An epoch directory (and `rolling/`) of many batches is read back by `readdir` offsets a bounded
    /// batch of entries per call, each entry made once: building all of them at every call made listing
    /// an epoch of N batches cost N²/100.
    #[test]
    fn large_epoch_directories_are_listed_a_batch_of_entries_per_call() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let client = MemoryClient::new(|_, _| (0..6000).map(|_| Bytes::from_static(b"x")).collect());
        let p = Prefetcher::new(Arc::new(client), rt.handle().clone(), PrefetcherConfig::default());
        let fs = Fs::new(p, options(BatchFormat::Tfrecord));
        for dir in [epochs::Node::Dir(3).ino(), rolling::ROLLING_DIR] {
            let mut names = Vec::new();
            let mut offset = 0;
            loop {
                let got = fs.dir_entries_from(dir, offset, 0).unwrap();
                if got.is_empty() {
                    break;
                }
                assert!(got.len() <= READDIR_BATCH + 2, "{} entries in one call", got.len());
                offset += got.len();
                names.extend(got.into_iter().map(|e| e.2));
            }
            assert_eq!(names.len(), 2 + 12_000, "every batch and twin once");
            assert_eq!((&names[2][..], &names[12_001][..]), ("batch-000000.tfrecord", "batch-005999.tfrecord.idx"));
        }
    }

    #[test]
    fn raw_tree_shows_the_source_files() {
        let (_rt, fs) = fs(BatchFormat::Tar);
        let raw = fs.lookup(ROOT, "raw", 0).unwrap().ino;
        let top: Vec<String> = fs.readdir(raw, 0).unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(top, ["a", "b", "s", "top.txt"]);
        let b = fs.lookup(raw, "b", 0).unwrap().ino;
        let c = fs.lookup(b, "c", 0).unwrap();
        assert!(c.dir);
        let c = c.ino;
        // `..` of a directory deep in raw/ is its parent (it once was the directory itself).
        let dots = |ino| fs.dir_entries(ino, 0).unwrap()[..2].to_vec();
        assert_eq!(dots(c), [(c, true, ".".to_owned()), (b, true, "..".to_owned())]);
        assert_eq!(dots(b)[1].0, raw);
        assert_eq!(dots(raw)[1].0, ROOT);
        assert_eq!(dots(ROOT)[1].0, ROOT);
        assert_eq!(dots(epochs::Node::Dir(1).ino())[1].0, ROOT);
        let listed: Vec<String> = fs.dir_entries(c, 0).unwrap().into_iter().map(|e| e.2).collect();
        assert_eq!(listed, [".", "..", "z.jpg"]);
        let z = fs.lookup(c, "z.jpg", 0).unwrap();
        assert_eq!(z.size, "contents of b/c/z.jpg".len() as u64);
        assert_eq!(fs.read(z.ino, 0, 1000, 1).unwrap(), "contents of b/c/z.jpg".as_bytes());
        assert_eq!(fs.read(z.ino, 9, 4, 1).unwrap(), "of b".as_bytes());
        // Across the boundary of its two 16-byte chunks, and from the second alone.
        assert_eq!(fs.read(z.ino, 12, 8, 1).unwrap(), "b/c/z.jp".as_bytes());
        assert_eq!(fs.read(z.ino, 17, 100, 1).unwrap(), ".jpg".as_bytes());
        assert_eq!(fs.read(z.ino, 21, 100, 1).unwrap(), "".as_bytes());
        assert_eq!(fs.lookup(raw, "nope", 0).unwrap_err().errno(), libc::ENOENT);
        assert_eq!(fs.lookup(z.ino, "x", 0).unwrap_err().errno(), libc::ENOTDIR);
    }

    #[test]
    fn errors_map_to_errnos() {
        let (_rt, fs) = fs(BatchFormat::Tar);
        let e0 = epochs::Node::Dir(0).ino();
        for missing in ["batch-000003.tar", "batch-000000.tfrecord", "batch-0.tar", "batch-0000001.tar", "x"] {
            assert_eq!(fs.lookup(e0, missing, 0).unwrap_err().errno(), libc::ENOENT, "{missing}");
        }
        for bad in ["epoch-1", "epoch-00001", "epoch-1000000", "epoch-+001", "nothing"] {
            assert_eq!(fs.lookup(ROOT, bad, 0).unwrap_err().errno(), libc::ENOENT, "{bad}");
        }
        let file = fs.lookup(e0, "batch-000000.tar", 0).unwrap().ino;
        assert_eq!(fs.lookup(file, "x", 0).unwrap_err().errno(), libc::ENOTDIR);
        assert_eq!(fs.open(file, true).unwrap_err().errno(), libc::EROFS);
        assert_eq!(fs.read(e0, 0, 10, 1).unwrap_err().errno(), libc::EISDIR);
        assert_eq!(fs.getattr(12345).unwrap_err().errno(), libc::ENOENT);
    }

    /// Resolves `path` from the root for process `owner`: its inode.
    fn resolve(fs: &Fs, path: &str, owner: u32) -> u64 {
        path.split('/').fold(ROOT, |dir, name| fs.lookup(dir, name, owner).unwrap().ino)
    }

    /// A new worker (a new `Fs` over the same ledger) numbers every view as the last one did, whatever
    /// order it is asked in: `raw/` walked in another order, `rolling/` names at the epochs the last worker
    /// moved them to, epoch directories, `.batchfs`.
    #[test]
    fn a_new_worker_numbers_every_view_as_the_last_one_did() {
        let ledger = Arc::new(crate::ledger::Ledger::create().unwrap());
        let (_rt, mut old) = fs(BatchFormat::Tfrecord);
        old.record_in(ledger.clone());
        let paths = [
            "raw/b/c/z.jpg",
            "raw/top.txt",
            "raw/a/y.jpg",
            "raw/a",
            ".batchfs/stats",
            "epoch-0001/batch-000002.tfrecord",
        ];
        let inos: Vec<u64> = paths.iter().map(|p| resolve(&old, p, 0)).collect();
        // rolling/: batch 0 opened twice (at epoch 1 next), batch 1 once.
        for name in ["batch-000000.tfrecord", "batch-000000.tfrecord", "batch-000001.tfrecord"] {
            let ino = resolve(&old, &format!("rolling/{name}"), 0);
            old.opened(ino, 0);
        }
        let rolling: Vec<u64> = (0..3).map(|b| resolve(&old, &format!("rolling/batch-{b:06}.tfrecord"), 0)).collect();
        drop(old);

        let (_rt, mut new) = fs(BatchFormat::Tfrecord);
        new.record_in(ledger);
        // The kernel holds the inodes: asked first by number, before any lookup.
        assert_eq!(new.getattr(inos[0]).unwrap().size, "contents of b/c/z.jpg".len() as u64);
        let mut again: Vec<(usize, u64)> =
            paths.iter().enumerate().rev().map(|(i, p)| (i, resolve(&new, p, 0))).collect();
        again.reverse();
        assert_eq!(again.into_iter().map(|(_, ino)| ino).collect::<Vec<_>>(), inos);
        let now: Vec<u64> = (0..3).map(|b| resolve(&new, &format!("rolling/batch-{b:06}.tfrecord"), 0)).collect();
        assert_eq!(now, rolling, "each rolling/ name at the epoch the last worker moved it to");
        assert_eq!(
            rolling::Node::from_ino(now[0]),
            Some(rolling::Node::File { epoch: 0, batch: 0, file: RollingFile::Packed })
        );
        assert_eq!(
            rolling::Node::from_ino(now[1]),
            Some(rolling::Node::File { epoch: 1, batch: 1, file: RollingFile::Packed })
        );
        // A fresh tree numbers raw/ by its own walk: the same paths, other numbers (what the ledger prevents).
        let (_rt, fresh) = fs(BatchFormat::Tfrecord);
        assert_ne!(resolve(&fresh, "raw/a/y.jpg", 0), inos[2]);
    }

    /// A new worker never serves a `raw/` inode the last one numbered past a full journal from another
    /// file: the kernel may still hold it (a dentry, cached pages, an open handle), so it is stale (ESTALE),
    /// and what the new worker lists is numbered after every number handed out before. Without the count of
    /// numbered nodes in the ledger, the new worker numbered `raw/a`'s files where the old one had put
    /// `raw/b/c/z.jpg` and `raw/a/y.jpg`, and read one file's bytes for another.
    #[test]
    fn raw_inodes_numbered_past_a_full_journal_are_stale_to_a_new_worker_never_another_file() {
        // Room for the root's listing alone (4 + 4 bytes): `raw/b`, `raw/b/c` and `raw/a` go unjournaled.
        let ledger = Arc::new(crate::ledger::Ledger::with_journal(8).unwrap());
        let (_rt, mut old) = fs(BatchFormat::Tfrecord);
        old.record_in(ledger.clone());
        let (z, y, top) =
            (resolve(&old, "raw/b/c/z.jpg", 0), resolve(&old, "raw/a/y.jpg", 0), resolve(&old, "raw/top.txt", 0));
        assert!(ledger.journal_full());
        drop(old);

        let (_rt, mut new) = fs(BatchFormat::Tfrecord);
        new.record_in(ledger.clone());
        // Listed in another order: `raw/a` first.
        let x = resolve(&new, "raw/a/x.jpg", 0);
        assert_eq!(new.read(x, 0, 100, 1).unwrap(), "contents of a/x.jpg".as_bytes());
        for (old_ino, path) in [(z, "b/c/z.jpg"), (y, "a/y.jpg")] {
            assert_eq!(new.read(old_ino, 0, 100, 1).map_err(|e| e.errno()), Err(libc::ESTALE), "{path}");
            assert_eq!(new.getattr(old_ino).map_err(|e| e.errno()).map(|a| a.size), Err(libc::ESTALE), "{path}");
            assert_eq!(new.open(old_ino, false).err().map(|e| e.errno()), Some(libc::ESTALE), "{path}");
        }
        assert_eq!(resolve(&new, "raw/top.txt", 0), top, "journaled: the same number");
        let z_now = resolve(&new, "raw/b/c/z.jpg", 0);
        assert!(z_now > z.max(y), "numbered after every number handed out before");
        assert_eq!(new.read(z_now, 0, 100, 1).unwrap(), "contents of b/c/z.jpg".as_bytes());
        drop(new);

        // A third worker: the second one's numbers past the journal are stale to it too.
        let (_rt, mut third) = fs(BatchFormat::Tfrecord);
        third.record_in(ledger);
        let s = resolve(&third, "raw/s", 0);
        assert_eq!(third.read(s, 0, 100, 1).unwrap(), "contents of s".as_bytes());
        for old_ino in [x, z_now, z] {
            assert_eq!(third.read(old_ino, 0, 100, 1).map_err(|e| e.errno()), Err(libc::ESTALE));
        }
        assert_eq!(third.read(resolve(&third, "raw/a/y.jpg", 0), 0, 100, 1).unwrap(), "contents of a/y.jpg".as_bytes());
    }

    /// A ledger whose journal a release before the count of `raw/`'s numbers filled (it went on journaling
    /// past a listing that did not fit, and numbered unrecorded): a new worker follows no journal, every
    /// number handed out before is stale (ESTALE), never another file; and so for the worker after it.
    #[test]
    fn raw_inodes_of_an_older_release_past_its_full_journal_are_stale_never_another_file() {
        let ledger = Arc::new(crate::ledger::Ledger::with_journal(8).unwrap());
        let (_rt, mut old) = fs(BatchFormat::Tfrecord);
        old.record_in(ledger.clone());
        let (z, y, top) =
            (resolve(&old, "raw/b/c/z.jpg", 0), resolve(&old, "raw/a/y.jpg", 0), resolve(&old, "raw/top.txt", 0));
        drop(old);
        ledger.as_left_by_an_older_release();

        let (_rt, mut new) = fs(BatchFormat::Tfrecord);
        new.record_in(ledger.clone());
        let x = resolve(&new, "raw/a/x.jpg", 0);
        assert_eq!(new.read(x, 0, 100, 1).unwrap(), "contents of a/x.jpg".as_bytes());
        for (old_ino, path) in [(z, "b/c/z.jpg"), (y, "a/y.jpg"), (top, "top.txt")] {
            assert_eq!(new.read(old_ino, 0, 100, 1).map_err(|e| e.errno()), Err(libc::ESTALE), "{path}");
        }
        let z_now = resolve(&new, "raw/b/c/z.jpg", 0);
        assert_eq!(new.read(z_now, 0, 100, 1).unwrap(), "contents of b/c/z.jpg".as_bytes());
        drop(new);

        let (_rt, mut third) = fs(BatchFormat::Tfrecord);
        third.record_in(ledger);
        for old_ino in [x, z_now, z, top] {
            assert_eq!(third.read(old_ino, 0, 100, 1).map_err(|e| e.errno()), Err(libc::ESTALE));
        }
        assert_eq!(third.read(resolve(&third, "raw/a/y.jpg", 0), 0, 100, 1).unwrap(), "contents of a/y.jpg".as_bytes());
    }

    /// A new worker's `shuffled/` hands out the sample after the last one the old worker handed out.
    #[test]
    fn a_new_worker_hands_out_shuffled_samples_from_where_the_last_one_stopped() {
        let take = |fs: &Fs, n: usize| -> Vec<u64> {
            let dir = resolve(fs, "shuffled/c0", 0);
            let names = fs.dir_entries(dir, 0).unwrap();
            (0..n)
                .map(|i| {
                    let ino = fs.lookup_as(dir, &names[2 + i].2, 1, 50).unwrap().ino;
                    fs.opened_as(ino, 1, 50);
                    ino
                })
                .collect()
        };
        let (_rt, reference, _) = class_tree(&[6, 2], (0, 1));
        let all = take(&reference, 5);
        let ledger = Arc::new(crate::ledger::Ledger::create().unwrap());
        let (_rt, mut old, _) = class_tree(&[6, 2], (0, 1));
        old.record_in(ledger.clone());
        assert_eq!(take(&old, 3), all[..3]);
        drop(old);
        let (_rt, mut new, _) = class_tree(&[6, 2], (0, 1));
        new.record_in(ledger);
        assert_eq!(take(&new, 2), all[3..], "the samples after the old worker's, not its first again");
    }

    /// The reference model of [`fs`]'s tree (tfrecord format): every path, `None` for a directory, the
    /// bytes for a file. `.batchfs/stats` changes as it is read, so the model holds only that it exists.
    /// The epoch the next open of each `rolling/` name gets, by (batch, index twin); absent: 0.
    type Next = std::collections::HashMap<(u64, bool), u64>;

    fn model(next: &Next) -> std::collections::BTreeMap<String, Option<Vec<u8>>> {
        let mut m = std::collections::BTreeMap::new();
        for dir in ["", ".batchfs", "raw", "raw/a", "raw/b", "raw/b/c"] {
            m.insert(dir.to_owned(), None);
        }
        m.insert(".batchfs/stats".to_owned(), Some(Vec::new()));
        for p in RAW_FILES {
            m.insert(format!("raw/{p}"), Some(format!("contents of {p}").into_bytes()));
        }
        // Epochs 0 and 1 are listed; 2 is not, and resolves by name all the same.
        for e in 0..3u64 {
            m.insert(epoch_name(e), None);
            for b in 0..3 {
                for f in [BatchFormat::Tfrecord, BatchFormat::TfrecordIdx] {
                    let body = format!("{f} epoch {e} batch {b}").into_bytes();
                    m.insert(format!("{}/{}", epoch_name(e), batch_name(b, f)), Some(body));
                }
            }
        }
        // rolling/: each name at the epoch its next open gets, in the packed layout.
        m.insert("rolling".into(), None);
        for b in 0..3 {
            for (index, f) in [(false, BatchFormat::Tfrecord), (true, BatchFormat::TfrecordIdx)] {
                let e = next.get(&(b, index)).copied().unwrap_or(0);
                m.insert(
                    format!("rolling/{}", batch_name(b, f)),
                    Some(format!("{f} epoch {e} batch {b}").into_bytes()),
                );
            }
        }
        m
    }

    /// The paths the operations pick from: the model's, and names that must not resolve.
    fn paths() -> Vec<String> {
        let mut all: Vec<String> = model(&Next::new()).into_keys().collect();
        all.extend(
            [
                "epoch-2",
                "epoch-00001",
                "batch-000000.tfrecord",
                "epoch-0000/batch-000003.tfrecord",
                "epoch-0000/batch-000000.tar",
                "epoch-0000/batch-0.tfrecord",
                "raw/nope",
                "raw/top.txt/x",
                "raw/a/x.jpg/y",
                "top.txt",
                ".batchfs/other",
                "epoch-0001/batch-000001.tfrecord/x",
                "rolling/batch-000003.tfrecord",
                "rolling/batch-000000.tar",
            ]
            .map(String::from),
        );
        all
    }

    /// Resolves `path` from the root, one lookup per component, as the kernel does.
    fn walk(fs: &Fs, path: &str) -> Result<Attr, i32> {
        let mut at = fs.getattr(ROOT).map_err(|e| e.errno())?;
        for part in path.split('/').filter(|p| !p.is_empty()) {
            at = fs.lookup(at.ino, part, 0).map_err(|e| e.errno())?;
        }
        Ok(at)
    }

    /// What the model says a lookup of `path` returns: its size, or the errno.
    fn model_walk(m: &std::collections::BTreeMap<String, Option<Vec<u8>>>, path: &str) -> Result<u64, i32> {
        let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
        for k in 1..parts.len() {
            if let Some(Some(_)) = m.get(&parts[..k].join("/")) {
                return Err(libc::ENOTDIR);
            }
        }
        match m.get(&parts.join("/")) {
            Some(Some(body)) => Ok(body.len() as u64),
            Some(None) => Ok(0),
            None => Err(libc::ENOENT),
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Lookup(usize),
        Readdir(usize),
        Read { path: usize, offset: u64, size: u32 },
        OpenClose(usize),
        Backing(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let n = paths().len();
        prop_oneof![
            (0..n).prop_map(Op::Lookup),
            (0..n).prop_map(Op::Readdir),
            (0..n, 0u64..40, 0u32..40).prop_map(|(path, offset, size)| Op::Read { path, offset, size }),
            (0..n).prop_map(Op::OpenClose),
            (0..n).prop_map(Op::Backing),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
        /// Reference model (as mountpoint-s3's reftests): random sequences of lookups, listings, reads,
        /// opens with their releases and passthrough opens give what the model says, in any order; each
        /// open of a `rolling/` name moves it to the next epoch.
        #[test]
        fn operations_match_the_reference_model(ops in proptest::collection::vec(op(), 1..40)) {
            let (_rt, fs) = fs(BatchFormat::Tfrecord);
            let mut next = Next::new();
            let all = paths();
            for op in ops {
                let m = model(&next);
                match op {
                    Op::Lookup(i) => {
                        let got = walk(&fs, &all[i]).map(|a| if all[i] == ".batchfs/stats" { 0 } else { a.size });
                        prop_assert_eq!(got, model_walk(&m, &all[i]), "lookup {}", all[i]);
                    }
                    Op::Readdir(i) => {
                        let (path, want) = (&all[i], model_walk(&m, &all[i]));
                        let Ok(attr) = walk(&fs, path) else { continue };
                        prop_assert!(want.is_ok());
                        let names = |e: Vec<Entry>| e.into_iter().map(|e| e.name).collect::<Vec<_>>();
                        let got = fs.readdir(attr.ino, 0).map(names);
                        if m.get(path.as_str()).is_some_and(|e| e.is_some()) {
                            prop_assert_eq!(got.map_err(|e| e.errno()), Err(libc::ENOTDIR), "readdir of file {}", path);
                            continue;
                        }
                        let prefix = if path.is_empty() { String::new() } else { format!("{path}/") };
                        let mut children: Vec<String> = m
                            .keys()
                            .filter_map(|k| k.strip_prefix(prefix.as_str()))
                            .filter(|r| !r.is_empty() && !r.contains('/'))
                            .map(String::from)
                            .filter(|name| !path.is_empty() || name != "epoch-0002") // not listed, only resolves
                            .collect();
                        let mut got = got.unwrap();
                        children.sort();
                        got.sort();
                        prop_assert_eq!(got, children, "readdir {}", path);
                    }
                    Op::Read { path, offset, size } => {
                        let Ok(attr) = walk(&fs, &all[path]) else { continue };
                        let got = fs.read(attr.ino, offset, size, 1);
                        match m.get(all[path].as_str()) {
                            // Read by the FUSE adapter from each open's snapshot, never through `Fs::read`.
                            Some(Some(_)) if all[path] == ".batchfs/stats" => prop_assert!(got.is_err()),
                            Some(Some(body)) => {
                                let start = (offset as usize).min(body.len());
                                let end = (offset as usize + size as usize).min(body.len());
                                prop_assert_eq!(&got.unwrap()[..], &body[start..end], "read {}", all[path]);
                            }
                            _ => prop_assert_eq!(got.map_err(|e| e.errno()), Err(libc::EISDIR)),
                        }
                    }
                    Op::OpenClose(i) => {
                        let Ok(attr) = walk(&fs, &all[i]) else { continue };
                        prop_assert_eq!(fs.open(attr.ino, true).map_err(|e| e.errno()), Err(libc::EROFS));
                        prop_assert!(fs.open(attr.ino, false).is_ok());
                        fs.opened(attr.ino, 0);
                        fs.closed(attr.ino);
                        // The span is the two listed epochs: 0, 1, 0, ...
                        if let Some(rolling::Node::File { epoch, batch, file }) = rolling::Node::from_ino(attr.ino) {
                            next.insert((batch, file == RollingFile::PackedIndex), (epoch + 1) % 2);
                            // The model holds no file open: the kernel would release it at once.
                            fs.released(attr.ino, 0);
                        }
                    }
                    Op::Backing(i) => {
                        let Ok(attr) = walk(&fs, &all[i]) else { continue };
                        let got = fs.backing_file(attr.ino, 1, true).map(|b| b.map(|b| b.file));
                        match m.get(all[i].as_str()) {
                            // A source file of more than one chunk reads through the daemon.
                            Some(Some(body)) if all[i].starts_with("raw/") && body.len() > 16 => {
                                prop_assert!(got.unwrap().is_none(), "no memory file for {}", all[i]);
                            }
                            Some(Some(body)) if all[i] != ".batchfs/stats" => {
                                use std::os::unix::fs::FileExt;
                                let file = got.unwrap().expect("a memory file");
                                let mut bytes = vec![0; body.len()];
                                file.read_exact_at(&mut bytes, 0).unwrap();
                                prop_assert_eq!(&bytes, body, "memory file of {}", all[i]);
                                prop_assert_eq!(file.metadata().unwrap().len(), body.len() as u64);
                            }
                            _ => prop_assert!(got.is_err(), "no memory file for {}", all[i]),
                        }
                    }
                }
            }
        }
    }

    /// A node of any view.
    #[derive(Debug, Clone, Copy)]
    enum AnyNode {
        Meta(u64),
        Epochs(epochs::Node),
        Rolling(rolling::Node),
        Raw(raw::Node),
        Shuffled(shuffled::Node),
    }

    impl AnyNode {
        fn ino(self) -> u64 {
            match self {
                AnyNode::Meta(ino) => ino,
                AnyNode::Epochs(n) => n.ino(),
                AnyNode::Rolling(n) => n.ino(),
                AnyNode::Raw(n) => n.ino(),
                AnyNode::Shuffled(n) => n.ino(),
            }
        }

        /// Whether its view decodes its inode back to it.
        fn round_trips(self) -> bool {
            let ino = self.ino();
            match self {
                AnyNode::Meta(ino) => ino == views::meta::META_DIR || ino == STATS_FILE,
                AnyNode::Epochs(n) => epochs::Node::from_ino(ino) == Some(n),
                AnyNode::Rolling(n) => rolling::Node::from_ino(ino) == Some(n),
                AnyNode::Raw(n) => raw::Node::from_ino(ino) == Some(n),
                AnyNode::Shuffled(n) => shuffled::Node::from_ino(ino) == Some(n),
            }
        }
    }

    fn any_node() -> impl Strategy<Value = AnyNode> {
        use batchfs::plan::MAX_EPOCH;
        let (epoch, batch) = (0..=MAX_EPOCH, 0..epochs::MAX_BATCHES);
        let file = prop_oneof![Just(RollingFile::Packed), Just(RollingFile::PackedIndex), Just(RollingFile::Indexed)];
        let (class, k) = (0..shuffled::MAX_CLASSES as u32, 0..shuffled::MAX_CLASS_SAMPLES);
        prop_oneof![
            Just(AnyNode::Meta(views::meta::META_DIR)),
            Just(AnyNode::Meta(STATS_FILE)),
            epoch.clone().prop_map(|e| AnyNode::Epochs(epochs::Node::Dir(e))),
            (epoch.clone(), batch.clone(), any::<bool>())
                .prop_map(|(epoch, batch, index)| AnyNode::Epochs(epochs::Node::Batch { epoch, batch, index })),
            Just(AnyNode::Rolling(rolling::Node::Dir)),
            (epoch.clone(), batch.clone(), file)
                .prop_map(|(epoch, batch, file)| AnyNode::Rolling(rolling::Node::File { epoch, batch, file })),
            batch.prop_map(|batch| AnyNode::Rolling(rolling::Node::Twin { batch })),
            any::<u32>().prop_map(|n| AnyNode::Raw(raw::Node::Dir(n))),
            any::<u32>().prop_map(|n| AnyNode::Raw(raw::Node::File(n))),
            Just(AnyNode::Shuffled(shuffled::Node::Dir)),
            class.clone().prop_map(|c| AnyNode::Shuffled(shuffled::Node::Class(c))),
            (epoch, class, k).prop_map(|(epoch, class, k)| AnyNode::Shuffled(shuffled::Node::Sample {
                epoch,
                class,
                k
            })),
        ]
    }

    /// A filesystem with every view, kept for the property test's cases.
    fn every_view() -> &'static Fs {
        static FS: std::sync::OnceLock<(tokio::runtime::Runtime, Fs)> = std::sync::OnceLock::new();
        &FS.get_or_init(|| {
            let (rt, fs, _) = class_tree(&[1], (0, 1));
            (rt, fs)
        })
        .1
    }

    proptest! {
        /// Every node's inode names it and no other: its view decodes it back, and no other view owns it
        /// (the views' numbers never meet, and none is the root's).
        #[test]
        fn inodes_round_trip_and_each_is_one_views(node in any_node()) {
            prop_assert!(node.round_trips(), "{:?}", node);
            let owners = every_view().views.iter().filter(|v| v.owns(node.ino())).count();
            prop_assert_eq!(owners, 1, "{:?}", node);
            prop_assert_ne!(node.ino(), ROOT);
        }
    }
}
