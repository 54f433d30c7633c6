//! Open files: how each open reads (through the daemon, or by passthrough from a memory file the kernel
//! holds), whether passthrough is on, the memory files held while the kernel reads them, the page cache a
//! file read through the daemon leaves at its last close, and, for a worker taking over a mount, the
//! handles the worker before it left. The FUSE adapter (`fuse.rs`) asks this at every open and release and
//! replies with what it answers; what it asks of the kernel goes through [`Kernel`]: the FUSE connection in
//! a mount, a fake in the tests.
//!
//! **Passthrough.** Where the kernel offers FUSE passthrough and it is not turned off, an open of a file
//! waits until the file is verified and cached, then registers a sealed memory file holding it as a
//! backing file, so the reads and mmap faults of that handle never reach the daemon. The kernel demands
//! one backing file per inode at a time, and no mixing of passthrough and daemon opens of one inode; the
//! handle table (`handles.rs`) keeps that. The backing id lives until the inode's last handle is released.
//! A backing file the kernel refuses turns passthrough off for the mount. A `raw/` file the node cache
//! holds is registered as its file there, checked at the open, not copied into memory; if the kernel
//! refuses that (a `cache_dir` on overlayfs, a stacked filesystem), such files go through memory files
//! from then on.

use super::handles::{Handles, Mode, Owners};
use super::page_drops::PageDrops;
use super::{Backing, Fs, FsError};
use crate::ledger::{Ledger, Settings};
use crate::prefetch::ReadError;
use crate::stats::Stats;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What the open files ask of the kernel.
pub trait Kernel: Send + Sync {
    /// Registers `file` as a backing file of the connection: its backing id.
    fn open_backing(&self, file: &File) -> std::io::Result<u32>;
    /// Closes backing id `id` of the connection.
    fn close_backing(&self, id: u32) -> std::io::Result<()>;
    /// Drops the page cache of inode `ino`.
    fn drop_pages(&self, ino: u64) -> std::io::Result<()>;
}

/// The bit the kernel sets in the id of a request it re-sends (`FUSE_UNIQUE_RESEND`, Linux 6.9).
pub const RESENT: u64 = 1 << 63;

/// Backing ids on each side of the largest recorded that a takeover closes unless a handle uses them.
const SWEPT: u32 = 256;

/// The mount's open files.
pub struct OpenFiles {
    kernel: Arc<dyn Kernel>,
    /// Try FUSE passthrough (the `passthrough` option, as `INIT` settled it); off once the kernel refuses.
    passthrough: AtomicBool,
    /// Hand the kernel the node cache's files themselves; off once it refuses one.
    disk_backing: AtomicBool,
    /// Drop the page cache of a file read through the daemon at its last close (`page_cache=drop`).
    drop_page_cache: bool,
    /// Where those drops are made: never on a FUSE thread (`page_drops.rs`).
    page_drops: PageDrops,
    handles: Mutex<Handles>,
    /// The memory files of inodes open by passthrough, held while they are (the cache keeps a held file).
    files: Mutex<HashMap<u64, Arc<File>>>,
    owners: Owners,
}

impl OpenFiles {
    pub fn new(kernel: Arc<dyn Kernel>, passthrough: bool, drop_page_cache: bool) -> Self {
        OpenFiles {
            page_drops: PageDrops::new(kernel.clone()),
            kernel,
            passthrough: AtomicBool::new(passthrough),
            disk_backing: AtomicBool::new(true),
            drop_page_cache,
            handles: Mutex::new(Handles::default()),
            files: Mutex::new(HashMap::new()),
            owners: Owners::default(),
        }
    }

    /// Whether opens try passthrough.
    pub fn passthrough(&self) -> bool {
        self.passthrough.load(Ordering::Relaxed)
    }

    /// Whether opens hand the kernel the node cache's files themselves.
    fn disk_backing(&self) -> bool {
        self.disk_backing.load(Ordering::Relaxed)
    }

    /// Whether opens try passthrough from now on (what `INIT` settled, or off once the kernel refused).
    pub fn settle(&self, fs: &Fs, on: bool) {
        self.passthrough.store(on, Ordering::Relaxed);
        fs.set_passthrough(on);
    }

    /// The process of thread `tid`.
    pub fn owner(&self, tid: u32) -> u32 {
        self.owners.of(tid)
    }

    /// Serves a connection whose `INIT` an earlier process answered (`settings`), taking over what
    /// `ledger` holds from the worker before this one: every open handle with its mode and backing id, the
    /// views' state, and the backing ids it left registered and unrecorded (closed now).
    pub fn take_over(&mut self, fs: &mut Fs, ledger: Arc<Ledger>, settings: Settings) {
        self.settle(fs, settings.passthrough);
        fs.record_in(ledger.clone());
        let (handles, closing) = Handles::restore(ledger.clone(), || fs.stats_json());
        let files = handles.files();
        for &(_, ino, owner) in &files {
            fs.adopted(ino, owner);
        }
        let live: HashSet<u32> = files
            .iter()
            .filter_map(|&(_, ino, _)| match handles.mode(ino) {
                Some(Mode::Passthrough(id)) => Some(id),
                _ => None,
            })
            .collect();
        // A worker killed between registering a backing id and recording it leaves the id registered:
        // ids are handed out in turn, so it is one of the last few; none that a live handle uses is closed.
        let max = ledger.max_backing();
        let mut closed = 0;
        for id in closing.into_iter().chain(max.saturating_sub(SWEPT) + 1..=max.saturating_add(SWEPT)) {
            if !live.contains(&id) && self.kernel.close_backing(id).is_ok() {
                closed += 1;
            }
        }
        if ledger.counters().restarts > 0 || !files.is_empty() {
            tracing::info!(handles = files.len(), passthrough = live.len(), closed, "took over the open handles");
        }
        *self.handles.get_mut().expect("handles") = handles;
    }

    /// Opens file `ino` for reading by thread `tid`, for open request `unique`: in the mode the inode is
    /// already open in, else by passthrough when on. Returns the handle and how it reads. An open the
    /// kernel re-sends (its last worker died before answering it) gets the handle recorded for it.
    pub fn open(&self, fs: &Fs, ino: u64, tid: u32, unique: u64) -> Result<(u64, Mode), FsError> {
        let owner = self.owners.of(tid);
        {
            let mut handles = self.handles.lock().expect("handles");
            if unique & RESENT != 0 {
                if let Some((fh, mode)) = handles.resent(unique & !RESENT) {
                    return Ok((fh, mode.unwrap_or(Mode::Daemon)));
                }
            }
            if let Some(mode) = handles.mode(ino) {
                if let Mode::Passthrough(_) = mode {
                    // The file's bytes are in the kernel already: a hit.
                    Stats::add(&fs.stats().passthrough_opens, 1);
                    Stats::add(&fs.stats().hits, 1);
                }
                return Ok(self.open_as(fs, &mut handles, ino, (owner, tid), Mode::Daemon, unique));
            }
        }
        let mut mode = Mode::Daemon;
        let mut made = None;
        while self.passthrough() {
            // Waits for the file (bounded by `timeout`), holding no lock. A large source file has no
            // backing file: it reads through the daemon, chunk by chunk.
            let backing = match fs.backing_file(ino, owner, self.disk_backing()) {
                Ok(backing) => backing,
                // No memory file for it now (short of descriptors, or of memory): the file is cached, and
                // this open reads it through the daemon.
                Err(FsError::Io(ReadError::Backing(e))) => {
                    static WARNED: AtomicBool = AtomicBool::new(false);
                    if !WARNED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "no backing file: such opens read through the daemon");
                    }
                    None
                }
                Err(e) => return Err(e),
            };
            let Some(Backing { file, on_disk }) = backing else { break };
            match self.kernel.open_backing(&file) {
                Ok(id) => {
                    if let Some(ledger) = self.handles.lock().expect("handles").ledger() {
                        ledger.backing_registered(id);
                    }
                    mode = Mode::Passthrough(id);
                    made = Some((id, file));
                    break;
                }
                Err(e) if on_disk => {
                    // The node cache's disk, not passthrough: its files go through memory from now on.
                    tracing::warn!(error = %e, "the kernel refused a node cache file: opens copy them into memory");
                    self.disk_backing.store(false, Ordering::Relaxed);
                    fs.refuse_disk();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the kernel refused a backing file: reads go through the daemon");
                    self.settle(fs, false);
                }
            }
        }
        let mut handles = self.handles.lock().expect("handles");
        let (fh, got) = self.open_as(fs, &mut handles, ino, (owner, tid), mode, unique);
        if let Some((id, file)) = made {
            if got == Mode::Passthrough(id) {
                self.files.lock().expect("files").insert(ino, file);
            } else {
                // Another open of the inode finished first: its mode stands, this backing id goes.
                self.close_backing(id);
            }
        }
        Ok((fh, got))
    }

    /// One more handle of `ino` for `(owner, tid)` in the mode it is open in, or in `mode` if it is not
    /// open (another open may have finished meanwhile: its mode wins).
    fn open_as(
        &self,
        fs: &Fs,
        handles: &mut Handles,
        ino: u64,
        who: (u32, u32),
        mode: Mode,
        unique: u64,
    ) -> (u64, Mode) {
        let (owner, tid) = who;
        fs.opened_as(ino, owner, tid);
        let (fh, mode) = handles.open(ino, owner, mode, unique & !RESENT);
        if mode == Mode::Daemon {
            Stats::add(&fs.stats().daemon_opens, 1);
        }
        (fh, mode)
    }

    /// Opens `.batchfs/stats` for open request `unique`: a handle that reads one snapshot of the counters
    /// (after a takeover, the handle the last worker recorded for a re-sent open, with a fresh snapshot).
    pub fn open_stats(&self, fs: &Fs, unique: u64) -> u64 {
        let mut handles = self.handles.lock().expect("handles");
        let resent = (unique & RESENT != 0).then(|| handles.resent(unique & !RESENT)).flatten();
        match resent {
            Some((fh, _)) => fh,
            None => handles.open_snapshot(fs.stats_json(), unique & !RESENT),
        }
    }

    /// The snapshot handle `fh` reads, if it is one of `.batchfs/stats`.
    pub fn snapshot(&self, fh: u64) -> Option<Arc<Vec<u8>>> {
        self.handles.lock().expect("handles").snapshot(fh)
    }

    /// Releases handle `fh`. At the inode's last handle its backing id closes, and the cache may evict the
    /// file. Returns the inode whose page cache to drop ([`OpenFiles::drop_pages`]) once the release is
    /// answered: every mapping of the file is gone by then (a mapping holds its file open).
    pub fn release(&self, fs: &Fs, fh: u64) -> Option<u64> {
        self.release_of(fs, fh, 0)
    }

    /// [`Self::release`] by release request `unique`: one the kernel re-sent after a takeover releases
    /// nothing this worker handed out ([`Handles::release_of`]).
    pub fn release_of(&self, fs: &Fs, fh: u64, unique: u64) -> Option<u64> {
        let released = self.handles.lock().expect("handles").release_of(fh, unique & RESENT != 0)?;
        fs.released(released.ino, released.owner);
        let mode = released.last?;
        if let Mode::Passthrough(id) = mode {
            self.close_backing(id);
            self.files.lock().expect("files").remove(&released.ino);
            self.handles.lock().expect("handles").closed(fh);
        }
        fs.closed(released.ino);
        (mode == Mode::Daemon && self.drop_page_cache).then_some(released.ino)
    }

    /// Has the page cache of `ino`, closed, dropped, on a thread of its own: the caller, a FUSE thread,
    /// never waits for the kernel's invalidation (`page_drops.rs`). A reader that opens it again reads it
    /// through the daemon once more. Without this the page cache keeps every batch file of every epoch
    /// read, a second copy of what the mount's cache holds, until the node runs short of memory.
    pub fn drop_pages(&self, fs: &Fs, ino: u64) {
        self.page_drops.drop_pages(ino, fs.shared_stats());
    }

    fn close_backing(&self, id: u32) {
        if let Err(e) = self.kernel.close_backing(id) {
            tracing::debug!(id, error = %e, "cannot close a backing id");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::MemoryClient;
    use crate::fs::views::{epochs, raw};
    use crate::fs::FsOptions;
    use crate::prefetch::{Prefetcher, PrefetcherConfig};
    use batchfs::encode::BatchFormat;
    use bytes::Bytes;
    use std::sync::Barrier;

    /// A connection's backing ids, as the kernel keeps them, and the inodes whose pages were dropped.
    #[derive(Default)]
    struct FakeKernel {
        ids: Mutex<(u32, HashSet<u32>)>,
        refuse: AtomicBool,
        /// Files of this device are refused (a disk the kernel cannot stack on).
        refuse_device: Option<u64>,
        /// Each backing file registered: its device and inode.
        handed: Mutex<Vec<(u64, u64)>>,
        /// Opens of backing files wait here for each other (a race of two opens of one inode).
        meet: Option<Barrier>,
        dropped: Mutex<Vec<u64>>,
    }

    impl FakeKernel {
        fn open_ids(&self) -> HashSet<u32> {
            self.ids.lock().unwrap().1.clone()
        }
    }

    impl Kernel for FakeKernel {
        fn open_backing(&self, file: &File) -> std::io::Result<u32> {
            assert!(file.metadata()?.len() > 0, "a backing file holds the file");
            if let Some(meet) = &self.meet {
                meet.wait();
            }
            use std::os::unix::fs::MetadataExt;
            let m = file.metadata()?;
            if self.refuse.load(Ordering::Relaxed) || self.refuse_device == Some(m.dev()) {
                return Err(std::io::Error::from_raw_os_error(libc::ELOOP));
            }
            self.handed.lock().unwrap().push((m.dev(), m.ino()));
            let mut ids = self.ids.lock().unwrap();
            ids.0 += 1;
            let id = ids.0;
            ids.1.insert(id);
            Ok(id)
        }

        fn close_backing(&self, id: u32) -> std::io::Result<()> {
            match self.ids.lock().unwrap().1.remove(&id) {
                true => Ok(()),
                false => Err(std::io::Error::from_raw_os_error(libc::ENOENT)),
            }
        }

        fn drop_pages(&self, ino: u64) -> std::io::Result<()> {
            self.dropped.lock().unwrap().push(ino);
            Ok(())
        }
    }

    /// A filesystem of two epochs of three batches, passthrough on.
    fn fs() -> (tokio::runtime::Runtime, Fs) {
        let client = MemoryClient::new(|epoch, f| {
            (0..3).map(|b| Bytes::from(format!("{f} epoch {epoch} batch {b}").into_bytes())).collect()
        });
        fs_of(Arc::new(client), None, vec![])
    }

    /// A filesystem of `client`'s dataset (two epochs, class folders `classes`) with the node cache `nc` if
    /// any, passthrough on.
    fn fs_of(
        client: Arc<MemoryClient>,
        nc: Option<Arc<crate::node_cache::NodeCache>>,
        classes: Vec<String>,
    ) -> (tokio::runtime::Runtime, Fs) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let p = Prefetcher::new(client, rt.handle().clone(), PrefetcherConfig::default());
        if let Some(nc) = nc {
            p.use_node_cache(nc);
        }
        let options = FsOptions {
            epochs: 2,
            format: BatchFormat::Tfrecord,
            uid: 0,
            gid: 0,
            time: std::time::SystemTime::UNIX_EPOCH,
            raw: true,
            rolling: crate::options::RollingMode::Packed,
            first_epoch: 0,
            classes,
        };
        let fs = Fs::new(p, options);
        fs.set_passthrough(true);
        (rt, fs)
    }

    fn batch(batch: u64) -> u64 {
        epochs::Node::Batch { epoch: 0, batch, index: false }.ino()
    }

    #[test]
    fn an_inode_open_twice_shares_one_backing_file_closed_at_its_last_release() {
        let (_rt, fs) = fs();
        let kernel = Arc::new(FakeKernel::default());
        let opens = OpenFiles::new(kernel.clone(), true, true);
        let (a, mode) = opens.open(&fs, batch(0), 100, 1).unwrap();
        let Mode::Passthrough(id) = mode else { panic!("{mode:?}") };
        let (b, again) = opens.open(&fs, batch(0), 200, 2).unwrap();
        assert_eq!((again, kernel.open_ids()), (mode, HashSet::from([id])), "one backing file for the inode");
        assert_ne!(a, b);
        assert_eq!(opens.release(&fs, a), None);
        assert_eq!(kernel.open_ids(), HashSet::from([id]), "still open by the other handle");
        assert_eq!(opens.release(&fs, b), None, "no page cache to drop: the kernel read the backing file");
        assert!(kernel.open_ids().is_empty() && opens.files.lock().unwrap().is_empty(), "closed at the last");
        assert_eq!(opens.release(&fs, b), None, "released twice");
        let s = fs.stats().snapshot();
        assert_eq!((s.passthrough_opens, s.daemon_opens), (2, 0), "{s:?}");
    }

    #[test]
    fn two_opens_racing_for_one_inode_keep_one_backing_id_and_close_the_other() {
        let (_rt, fs) = fs();
        let kernel = Arc::new(FakeKernel { meet: Some(Barrier::new(2)), ..FakeKernel::default() });
        let opens = OpenFiles::new(kernel.clone(), true, false);
        let (one, two) = std::thread::scope(|s| {
            let one = s.spawn(|| opens.open(&fs, batch(1), 100, 1).unwrap());
            let two = s.spawn(|| opens.open(&fs, batch(1), 200, 2).unwrap());
            (one.join().unwrap(), two.join().unwrap())
        });
        assert_eq!(one.1, two.1, "both handles read in the mode that won");
        let Mode::Passthrough(id) = one.1 else { panic!("{one:?}") };
        assert_eq!(kernel.open_ids(), HashSet::from([id]), "the losing backing id was closed");
        opens.release(&fs, one.0);
        opens.release(&fs, two.0);
        assert!(kernel.open_ids().is_empty());
    }

    #[test]
    fn a_backing_file_the_kernel_refuses_turns_passthrough_off_and_the_pages_drop_at_close() {
        let (_rt, fs) = fs();
        let kernel = Arc::new(FakeKernel { refuse: AtomicBool::new(true), ..FakeKernel::default() });
        let opens = OpenFiles::new(kernel.clone(), true, true);
        let (a, mode) = opens.open(&fs, batch(2), 100, 1).unwrap();
        assert_eq!(mode, Mode::Daemon);
        assert!(!opens.passthrough() && !fs.stats().snapshot().passthrough, "off for the mount");
        let (b, mode) = opens.open(&fs, batch(0), 100, 2).unwrap();
        assert_eq!(mode, Mode::Daemon);
        assert_eq!(opens.release(&fs, a), Some(batch(2)), "read through the daemon: its pages go at the close");
        opens.drop_pages(&fs, batch(2));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while fs.stats().snapshot().page_cache_drops < 1 {
            assert!(std::time::Instant::now() < deadline, "never dropped");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(*kernel.dropped.lock().unwrap(), [batch(2)]);
        let keep = OpenFiles::new(kernel, false, false);
        let (c, _) = keep.open(&fs, batch(0), 100, 3).unwrap();
        assert_eq!(keep.release(&fs, c), None, "page_cache=keep");
        assert_eq!(opens.release(&fs, b), Some(batch(0)));
    }

    /// A `raw/` file the node cache holds opens by passthrough from its file there: checked, neither
    /// fetched nor copied into memory. A kernel that refuses files of that disk (a `cache_dir` on
    /// overlayfs) gets memory files from then on, passthrough still on; a file found wrong on the disk
    /// is fetched anew.
    #[test]
    fn a_raw_file_the_node_cache_holds_is_handed_over_from_the_disk() {
        use crate::client::Sent;
        use crate::node_cache::NodeCache;
        use std::os::unix::fs::MetadataExt;
        let mut client = MemoryClient::new(|_, _| vec![]);
        let files: Vec<Bytes> = (0..3u8).map(|i| Bytes::from(vec![i + 1; 3000 + i as usize])).collect();
        client.files = files.iter().enumerate().map(|(i, f)| (format!("f{i}.jpg"), f.clone())).collect();
        let client = Arc::new(client);
        let disk = tempfile::tempdir().unwrap();
        let nc = NodeCache::open(disk.path(), 1 << 30, "d").unwrap();
        // File i is sample i of the file tree (its files sorted by path).
        let key = |i: usize| {
            let f = &files[i];
            crate::node_cache::Key::sample(Sent { bytes: f.len() as u64, crc32c: batchfs::crc::crc32c(f) }, i as u32)
        };
        (0..files.len()).for_each(|i| nc.put(key(i), &files[i]).unwrap());
        let (_rt, fs) = fs_of(client.clone(), Some(nc.clone()), vec![]);
        let ino = |i: usize| fs.lookup(raw::Node::Dir(0).ino(), &format!("f{i}.jpg"), 1).unwrap().ino;
        let on_disk = |i: usize| {
            let m = std::fs::metadata(nc.path_of(key(i))).unwrap();
            (m.dev(), m.ino())
        };

        let kernel = Arc::new(FakeKernel::default());
        let opens = OpenFiles::new(kernel.clone(), true, false);
        let (fh, mode) = opens.open(&fs, ino(0), 100, 1).unwrap();
        assert!(matches!(mode, Mode::Passthrough(_)), "{mode:?}");
        assert_eq!(*kernel.handed.lock().unwrap(), [on_disk(0)], "the node cache's own file");
        assert!(client.ranges.lock().unwrap().is_empty(), "nothing fetched");
        assert_eq!(fs.stats().snapshot().cache_bytes, 0, "nothing copied into memory");
        opens.release(&fs, fh);
        assert!(kernel.open_ids().is_empty());

        // A file changed on the disk is not handed over: removed, and fetched anew into memory.
        std::fs::write(nc.path_of(key(1)), vec![0u8; files[1].len()]).unwrap();
        let (fh, mode) = opens.open(&fs, ino(1), 100, 2).unwrap();
        assert!(matches!(mode, Mode::Passthrough(_)), "{mode:?}");
        assert_ne!(kernel.handed.lock().unwrap()[1], on_disk(0));
        assert_eq!(client.ranges.lock().unwrap().len(), 1, "fetched");
        assert_eq!(nc.stats.corrupt.load(Ordering::Relaxed), 1);
        opens.release(&fs, fh);

        let dev = on_disk(2).0;
        let kernel = Arc::new(FakeKernel { refuse_device: Some(dev), ..FakeKernel::default() });
        let opens = OpenFiles::new(kernel.clone(), true, false);
        let (fh, mode) = opens.open(&fs, ino(2), 100, 3).unwrap();
        assert!(matches!(mode, Mode::Passthrough(_)), "a memory file instead: {mode:?}");
        assert!(kernel.handed.lock().unwrap().iter().all(|h| h.0 != dev));
        assert!(opens.passthrough() && !opens.disk_backing(), "passthrough on, the node cache's files off");
        opens.release(&fs, fh);
        let (fh, _) = opens.open(&fs, ino(0), 100, 4).unwrap();
        assert_eq!(kernel.handed.lock().unwrap().len(), 2, "not asked again for a disk file");
        opens.release(&fs, fh);
    }

    /// A `raw/` file of several chunks that the node cache holds whole (as warming keeps it) opens by
    /// passthrough from its file there, checked whole; where the kernel refuses that disk, its chunks read
    /// through the daemon from that file, each alone (not the whole file again for every chunk) and checked
    /// against its own CRC. Neither fetches anything.
    #[test]
    fn a_raw_file_of_several_chunks_kept_whole_opens_from_the_disk() {
        use crate::client::Sent;
        use crate::node_cache::NodeCache;
        use std::os::unix::fs::MetadataExt;
        let mut client = MemoryClient::new(|_, _| vec![]);
        let big = Bytes::from((0..10_000u32).map(|i| (i % 253) as u8).collect::<Vec<u8>>());
        client.files = vec![("big.bin".to_string(), big.clone())];
        client.chunk_bytes = 4096;
        let client = Arc::new(client);
        let disk = tempfile::tempdir().unwrap();
        let nc = NodeCache::open(disk.path(), 1 << 30, "d").unwrap();
        let whole = Sent { bytes: big.len() as u64, crc32c: batchfs::crc::crc32c(&big) };
        let whole = crate::node_cache::Key::sample(whole, 0);
        nc.put(whole, &big).unwrap();
        let (_rt, fs) = fs_of(client.clone(), Some(nc.clone()), vec![]);
        let ino = fs.lookup(raw::Node::Dir(0).ino(), "big.bin", 1).unwrap().ino;
        let m = std::fs::metadata(nc.path_of(whole)).unwrap();

        let kernel = Arc::new(FakeKernel::default());
        let opens = OpenFiles::new(kernel.clone(), true, false);
        let (fh, mode) = opens.open(&fs, ino, 100, 1).unwrap();
        assert!(matches!(mode, Mode::Passthrough(_)), "{mode:?}");
        assert_eq!(*kernel.handed.lock().unwrap(), [(m.dev(), m.ino())], "the node cache's own file");
        opens.release(&fs, fh);

        let kernel = Arc::new(FakeKernel { refuse_device: Some(m.dev()), ..FakeKernel::default() });
        let opens = OpenFiles::new(kernel.clone(), true, false);
        let (fh, mode) = opens.open(&fs, ino, 100, 2).unwrap();
        assert_eq!(mode, Mode::Daemon, "a file of several chunks is never held whole in memory");
        let mut got = Vec::new();
        while got.len() < big.len() {
            let read = fs.read(ino, got.len() as u64, 3000, 100).unwrap();
            assert!(!read.is_empty());
            got.extend_from_slice(&read);
        }
        assert_eq!(got, big);
        opens.release(&fs, fh);
        assert!(client.ranges.lock().unwrap().is_empty(), "nothing fetched");
        let hit = nc.stats.hit_bytes.load(Ordering::Relaxed);
        // Checked whole at both opens (the refusing kernel's too), then each chunk read once.
        assert_eq!(hit, 3 * big.len() as u64, "{hit}");
    }

    /// A `shuffled/` sample the node cache holds (a file tree's sample is its file, as `warm=raw` keeps it)
    /// opens by passthrough from the node cache's own file, and its group is never fetched into memory:
    /// each sample is read from the disk once, by its open's check. Where the kernel refuses that disk,
    /// samples read through the daemon from their groups again.
    #[test]
    fn a_shuffled_sample_the_node_cache_holds_opens_from_the_disk() {
        use crate::client::Sent;
        use crate::node_cache::NodeCache;
        use std::os::unix::fs::MetadataExt;
        let mut client = MemoryClient::new(|_, _| vec![]);
        for i in 0..6u8 {
            client.files.push((format!("c0/f{i}.jpg"), Bytes::from(vec![i + 1; 1000 + usize::from(i)])));
        }
        let files = client.files.clone();
        let client = Arc::new(client);
        let disk = tempfile::tempdir().unwrap();
        let nc = NodeCache::open(disk.path(), 1 << 30, "d").unwrap();
        let key = |i: usize, f: &Bytes| {
            crate::node_cache::Key::sample(Sent { bytes: f.len() as u64, crc32c: batchfs::crc::crc32c(f) }, i as u32)
        };
        files.iter().enumerate().for_each(|(i, (_, f))| nc.put(key(i, f), f).unwrap());
        let on_disk: HashSet<(u64, u64)> = files
            .iter()
            .enumerate()
            .map(|(i, (_, f))| std::fs::metadata(nc.path_of(key(i, f))).map(|m| (m.dev(), m.ino())).unwrap())
            .collect();
        let (_rt, fs) = fs_of(client.clone(), Some(nc.clone()), vec!["c0".into()]);
        let dir = fs.lookup(crate::fs::ROOT, "shuffled", 0).unwrap().ino;
        let class = fs.lookup(dir, "c0", 0).unwrap().ino;

        let kernel = Arc::new(FakeKernel::default());
        let opens = OpenFiles::new(kernel.clone(), true, false);
        for n in 0..files.len() as u64 {
            let sample = fs.lookup(class, "f0.jpg", 100).unwrap().ino;
            let (fh, mode) = opens.open(&fs, sample, 100, n).unwrap();
            assert!(matches!(mode, Mode::Passthrough(_)), "{mode:?}");
            opens.release(&fs, fh);
        }
        let handed: HashSet<(u64, u64)> = kernel.handed.lock().unwrap().iter().copied().collect();
        assert_eq!(handed, on_disk, "every sample handed over as its own file in the node cache");
        assert!(client.sampled.lock().unwrap().is_empty(), "no group fetched");
        let all: u64 = files.iter().map(|(_, f)| f.len() as u64).sum();
        assert_eq!(nc.stats.hit_bytes.load(Ordering::Relaxed), all, "each sample read from the disk once");

        // A kernel that refuses files of that disk: the samples are read through the daemon again.
        let dev = on_disk.iter().next().unwrap().0;
        let kernel = Arc::new(FakeKernel { refuse_device: Some(dev), ..FakeKernel::default() });
        let opens = OpenFiles::new(kernel.clone(), true, false);
        for n in 0..2 {
            let sample = fs.lookup(class, "f0.jpg", 100).unwrap().ino;
            let (fh, mode) = opens.open(&fs, sample, 100, 99 + n).unwrap();
            assert_eq!(mode, Mode::Daemon, "a sample is read from its group");
            let got = fs.read(sample, 0, 1 << 20, 100).unwrap();
            assert!(files.iter().any(|(_, f)| *f == got), "{} bytes, no sample's", got.len());
            opens.release(&fs, fh);
        }
        assert!(kernel.handed.lock().unwrap().is_empty() && !opens.disk_backing());
    }

    #[test]
    fn a_file_that_cannot_be_had_fails_its_open_and_holds_nothing() {
        let (_rt, fs) = fs();
        let kernel = Arc::new(FakeKernel::default());
        let opens = OpenFiles::new(kernel.clone(), true, false);
        let missing = epochs::Node::Batch { epoch: 0, batch: 99, index: false }.ino();
        assert!(opens.open(&fs, missing, 100, 1).is_err());
        assert!(kernel.open_ids().is_empty() && opens.handles.lock().unwrap().files().is_empty());
    }

    #[test]
    fn a_new_worker_keeps_the_live_backing_ids_and_closes_those_the_dead_one_left_unrecorded() {
        let kernel = Arc::new(FakeKernel::default());
        let ledger = Arc::new(Ledger::create().unwrap());
        let settings = Settings { passthrough: true, resend: true };
        let (_rt, mut old_fs) = fs();
        let mut old = OpenFiles::new(kernel.clone(), true, false);
        old.take_over(&mut old_fs, ledger.clone(), settings);
        let (fh, mode) = old.open(&old_fs, batch(0), 100, 41).unwrap();
        let Mode::Passthrough(live) = mode else { panic!("{mode:?}") };
        // The worker dies between registering a backing id and recording a handle for it.
        let file = crate::sys::memfd("left").unwrap();
        file.set_len(1).unwrap();
        let left = kernel.open_backing(&file).unwrap();
        ledger.backing_registered(left);
        drop(old);
        let (_rt2, mut new_fs) = fs();
        let mut new = OpenFiles::new(kernel.clone(), false, false);
        new.take_over(&mut new_fs, ledger, settings);
        assert!(new.passthrough(), "the connection's settings stand");
        assert_eq!(kernel.open_ids(), HashSet::from([live]), "the unrecorded id closed, the live one kept");
        assert_eq!(new.open(&new_fs, batch(0), 100, 41 | RESENT).unwrap(), (fh, mode), "a re-sent open");
        let (other, again) = new.open(&new_fs, batch(0), 300, 42).unwrap();
        assert_eq!(again, mode, "the inode reads from the backing file the last worker registered");
        new.release(&new_fs, other);
        new.release(&new_fs, fh);
        assert!(kernel.open_ids().is_empty());
    }

    /// The dead worker freed a released handle's slot and died before it answered; the new worker hands a
    /// new open that slot's number, then gets the release again (re-sent): the new handle stays open, its
    /// backing id too. Before, it was released in its place (mode forgotten, backing id closed while open).
    #[test]
    fn a_resent_release_never_releases_the_handle_the_new_worker_gave_its_slot() {
        let kernel = Arc::new(FakeKernel::default());
        let ledger = Arc::new(Ledger::create().unwrap());
        let settings = Settings { passthrough: true, resend: true };
        let (_rt, mut old_fs) = fs();
        let mut old = OpenFiles::new(kernel.clone(), true, false);
        old.take_over(&mut old_fs, ledger.clone(), settings);
        let (fh, _) = old.open(&old_fs, batch(0), 100, 41).unwrap();
        old.release_of(&old_fs, fh, 42);
        drop(old);
        let (_rt2, mut new_fs) = fs();
        let mut new = OpenFiles::new(kernel.clone(), true, false);
        new.take_over(&mut new_fs, ledger, settings);
        let (again, mode) = new.open(&new_fs, batch(1), 200, 50).unwrap();
        assert_eq!(again, fh, "the lowest free slot: the same number");
        let Mode::Passthrough(id) = mode else { panic!("{mode:?}") };
        assert_eq!(new.release_of(&new_fs, fh, 42 | RESENT), None);
        assert_eq!(new.handles.lock().unwrap().files(), [(again, batch(1), 200)], "still open");
        assert_eq!(kernel.open_ids(), HashSet::from([id]), "its backing id too");
        assert_eq!(new.release_of(&new_fs, again, 60), None, "passthrough: no pages to drop");
        assert!(kernel.open_ids().is_empty() && new.handles.lock().unwrap().files().is_empty());
    }
}
