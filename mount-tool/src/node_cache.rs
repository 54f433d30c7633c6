//! The node cache (`cache_dir=PATH`): verified objects kept on a local disk, in front of the network and
//! behind the memory cache, surviving remounts and restarts and shared by every mount on the node.
//!
//! **Keys are contents and names.** An object is filed under its size and CRC32C as the server lists them
//! and which object of its dataset it is ([`Key`]: `PATH/ab/abcdef01-SIZE-ID`, `ab` the CRC's first byte,
//! `ID` a hash of the dataset's namespace (the mount's server and the dataset's name) and the object's: a
//! sample's id, a file's path, a batch's epoch, plan and number): a file changed on the server has a new
//! key, so nothing in the cache is ever stale, and two mounts of one dataset through one server URL (pods
//! of one job, or of several) find each other's objects. The server is part of the name because a CRC32C
//! is no authentication (anyone can give bytes any CRC): a mount of another server, whoever runs it, with a
//! dataset of the same name and a shared `cache_dir`, files its objects under names of its own. The size and CRC
//! alone are no name: two objects of one size share a CRC32C once in 2^32 pairs, which a dataset of a
//! million chunks or batches of one size meets about a hundred times (the birthday bound), and a check of
//! size and CRC cannot tell them apart. A file is written under a temporary name and renamed into place, so a reader
//! never opens a partial one; every read checks the size and CRC32C again before a byte is used, and a
//! file that fails (a disk's corruption, a truncation) is removed and fetched anew.
//!
//! **Checked once a mount, while unchanged.** Reading a file back to check it costs a copy of it at every
//! open (a quarter of the daemon's CPU under ImageFolder over `raw/`), so a mount remembers the files it
//! wrote or checked (up to `cache_dir_checks` of them) by their inode's identity: inode number, size, and
//! the change time, which the kernel moves at every write, truncation or rename and which no one can set.
//! An open that finds the file as it was left skips the read; any other is checked again. A file checked is
//! remembered as it was before its check read, and only if it is so after it (a write during the read moves
//! the change time: the file is read again at its next open). The change time
//! must move at a change however soon it follows: on filesystems whose times are a clock tick coarse (no
//! multigrain timestamps, before Linux 6.13), a file is remembered only once its change time is older than
//! a tick, as git's index treats "racily clean" entries. What this gives up: a disk that corrupts a file's
//! blocks without a write is caught at the next mount's first open, not at every open. The kernel's page
//! cache is what the check read either way, and what a passthrough reader reads after it.
//!
//! **Bounded.** The bytes written are counted against `cache_dir_size`; past it, the least recently used
//! files (by modification time, touched at a hit when it is older than [`TOUCH_AFTER`]) are removed until
//! the cache is under 90 % of it. The count starts from a walk of the directory at mount time, in the
//! background.

use crate::client::Sent;
use crate::stats::NodeCacheSnapshot;
use crate::sync::{AtomicU64, Mutex, Ordering};
use batchfs::api::Manifest;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A hit touches a file's modification time (its place in the LRU order) only when it is older than this:
/// a touch is an inode write (a journal entry) at every open otherwise, and the order needs no finer grain.
pub const TOUCH_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// The check's buffer (1 MiB), one per thread and reused: a fresh one per open cost an allocation, its
/// zeroing and page faults, and the unmap's TLB shootdowns, more than the check's copy of a small file.
const CHECK_BUFFER: usize = 1 << 20;

/// A change time at least this old moves at any later change, whatever the clock's grain (a tick is at most
/// 10 ms, at `HZ=100`).
const SETTLED: std::time::Duration = std::time::Duration::from_millis(20);

/// Files whose check a mount remembers by default (`cache_dir_checks`): about 10 MB at most.
pub const DEFAULT_CHECKS: usize = 1 << 17;

/// What the node cache files an object under: its size and CRC32C as the server lists them (what every
/// read of the file checks), and which object of its dataset it is (`id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    pub sent: Sent,
    pub id: u64,
}

impl Key {
    /// Sample `sample` (in a file tree, also the file it is: `raw/`, `shuffled/` and warming share it).
    pub fn sample(sent: Sent, sample: u32) -> Key {
        Key { sent, id: ident(&[b"sample", &sample.to_le_bytes()]) }
    }

    /// The file at `path`, whole: the sample it is in a file tree (`sample`), else the shard's path.
    pub fn file(sent: Sent, path: &str, sample: Option<u32>) -> Key {
        match sample {
            Some(s) => Key::sample(sent, s),
            None => Key { sent, id: ident(&[b"file", path.as_bytes()]) },
        }
    }

    /// The file listed as `f`, whole.
    pub fn whole(f: &batchfs::api::FileEntry) -> Key {
        Key::file(Sent { bytes: f.size, crc32c: f.crc32c }, &f.path, f.sample)
    }

    /// The chunk at `offset` of the file `whole`.
    pub fn chunk(sent: Sent, whole: Key, offset: u64) -> Key {
        Key { sent, id: ident(&[b"chunk", &whole.id.to_le_bytes(), &offset.to_le_bytes()]) }
    }

    /// Batch `batch` of `manifest`'s epoch, format and plan.
    pub fn batch(sent: Sent, manifest: &Manifest, batch: u64) -> Key {
        // The plan and the format, as the query that asks for the batch says them.
        let plan = batchfs::api::BatchQuery { plan: manifest.options, format: manifest.format }.to_query();
        let epoch = manifest.epoch.to_le_bytes();
        Key { sent, id: ident(&[b"batch", &epoch, plan.as_bytes(), &batch.to_le_bytes()]) }
    }
}

/// A stable 64-bit hash (FNV-1a) of `parts`, each after its length, so that no two lists of parts are one
/// text: the same in every process and build, as the names of the files of a cache shared by mounts are.
pub fn ident(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

thread_local! {
    static CHECK: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A node cache in a directory.
#[derive(Debug)]
pub struct NodeCache {
    dir: PathBuf,
    /// The dataset's namespace (server and name), hashed: what each file's name holds besides its object's
    /// [`Key`].
    namespace: u64,
    limit: u64,
    /// A hit older than this touches the file ([`TOUCH_AFTER`]).
    touch_after: std::time::Duration,
    /// Bytes in the cache (the walk's count, plus what this mount wrote, minus what it removed).
    used: AtomicU64,
    /// One eviction at a time (in this mount).
    evicting: Mutex<()>,
    /// The files this mount wrote or checked, as they were then (none: checked at every open).
    checks: Option<Mutex<lru::LruCache<Key, Stamp>>>,
    /// Whether a change right after a look at a file moves its change time (multigrain timestamps):
    /// then a file is remembered as soon as it is written or checked.
    fine_times: bool,
    pub stats: NodeCacheStats,
}

/// What identifies a file's contents as they were when a mount wrote or checked it: the kernel moves the
/// change time at every write, truncation or rename of the inode, and it cannot be set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    size: u64,
    ctime: (i64, i64),
}

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Stamp { ino: m.ino(), size: m.size(), ctime: (m.ctime(), m.ctime_nsec()) }
    }

    /// Whether a change from now on surely moves the change time: with fine times always; else once the
    /// change time is older than a clock tick.
    fn settled(&self, fine_times: bool) -> bool {
        let changed = std::time::UNIX_EPOCH + std::time::Duration::new(self.ctime.0.max(0) as u64, self.ctime.1 as u32);
        fine_times || std::time::SystemTime::now().duration_since(changed).is_ok_and(|age| age >= SETTLED)
    }
}

/// What the node cache did.
#[derive(Debug, Default)]
pub struct NodeCacheStats {
    /// Objects read from the disk instead of the network.
    pub hits: AtomicU64,
    pub hit_bytes: AtomicU64,
    /// Objects written to it.
    pub writes: AtomicU64,
    pub written_bytes: AtomicU64,
    /// Files found corrupt (size or CRC32C), removed and fetched anew.
    pub corrupt: AtomicU64,
    /// Files removed to stay under the limit.
    pub evictions: AtomicU64,
    /// Opens that found the file as this mount had written or checked it, and did not read it again.
    pub unread: AtomicU64,
}

impl NodeCache {
    /// The cache in `dir` (made if missing) of the objects of the dataset that `namespace` names
    /// ([`crate::client::HttpConfig::cache_namespace`]; mounts of other datasets and servers may
    /// share the directory), at most `limit` bytes, remembering [`DEFAULT_CHECKS`] checks.
    pub fn open(dir: &Path, limit: u64, namespace: &str) -> std::io::Result<std::sync::Arc<Self>> {
        Self::open_with(dir, limit, DEFAULT_CHECKS, TOUCH_AFTER, namespace)
    }

    /// The same, remembering the checks of `checks` files (0: every open reads its file again).
    pub fn open_remembering(
        dir: &Path,
        limit: u64,
        checks: usize,
        namespace: &str,
    ) -> std::io::Result<std::sync::Arc<Self>> {
        Self::open_with(dir, limit, checks, TOUCH_AFTER, namespace)
    }

    /// The same, a hit touching a file whose modification time is `touch_after` old.
    fn open_with(
        dir: &Path,
        limit: u64,
        checks: usize,
        touch_after: std::time::Duration,
        namespace: &str,
    ) -> std::io::Result<std::sync::Arc<Self>> {
        if dir.exists() && !dir.is_dir() {
            return Err(std::io::Error::new(std::io::ErrorKind::NotADirectory, "it is not a directory"));
        }
        if !dir.exists() && dir.is_symlink() {
            // Its making failed as "File exists".
            let to = std::fs::read_link(dir).unwrap_or_default();
            let why = format!("it is a link to {}, which does not exist", to.display());
            return Err(std::io::Error::new(std::io::ErrorKind::NotFound, why));
        }
        std::fs::create_dir_all(dir)?;
        let cache = std::sync::Arc::new(NodeCache {
            dir: dir.to_owned(),
            namespace: ident(&[b"dataset", namespace.as_bytes()]),
            limit,
            touch_after,
            used: AtomicU64::new(0),
            evicting: Mutex::new(()),
            checks: std::num::NonZeroUsize::new(checks).map(|n| Mutex::new(lru::LruCache::new(n))),
            fine_times: checks > 0 && changes_show_at_once(dir),
            stats: NodeCacheStats::default(),
        });
        let walker = cache.clone();
        std::thread::Builder::new().name("batchfs-node-cache".into()).spawn(move || {
            let found: u64 = walker.entries().iter().map(|e| e.1).sum();
            walker.used.fetch_add(found, Ordering::Relaxed);
            walker.evict_if_full();
        })?;
        Ok(cache)
    }

    /// The path of the object `key`.
    pub fn path_of(&self, key: Key) -> PathBuf {
        let id = ident(&[&self.namespace.to_le_bytes(), &key.id.to_le_bytes()]);
        let name = format!("{:08x}-{}-{id:016x}", key.sent.crc32c, key.sent.bytes);
        self.dir.join(&name[..2]).join(name)
    }

    /// The object `key`, if the cache holds it whole and right (a wrong file is removed).
    pub fn get(&self, key: Key) -> Option<Vec<u8>> {
        self.get_part(key, 0, key.sent)
    }

    /// The bytes `part` (size and CRC32C) at `offset` of the object `whole`, if the cache holds that
    /// object's file at its size with those bytes right: a chunk of a file kept whole, read alone, not
    /// with the rest of the file. A file of another size, or whose part is wrong, is removed.
    pub fn get_part(&self, whole: Key, offset: u64, part: Sent) -> Option<Vec<u8>> {
        if offset.checked_add(part.bytes).is_none_or(|end| end > whole.sent.bytes) {
            return None;
        }
        let path = self.path_of(whole);
        let file = self.open_file(&path)?;
        let before = self.before_check(&file);
        let size = before.map_or(0, |b| b.size);
        let mut data = vec![0u8; usize::try_from(part.bytes).ok()?];
        let read = std::os::unix::fs::FileExt::read_exact_at(&file, &mut data, offset).is_ok();
        let right = size == whole.sent.bytes && read && batchfs::crc::crc32c(&data) == part.crc32c;
        self.checked(&path, &file, whole, (part.bytes, before), right, size)?;
        Some(data)
    }

    /// The file of the object `key`, if the cache holds it whole and right, for the kernel to serve
    /// straight from the disk (FUSE passthrough; a wrong file is removed). Checked now, read through a
    /// small buffer: its pages are then in the page cache for the reader that opened it. A file is never
    /// written in place (it is renamed into place whole and removed whole), so what was checked is what
    /// the kernel serves.
    pub fn open_checked(&self, key: Key) -> Option<std::fs::File> {
        let (path, sent) = (self.path_of(key), key.sent);
        let file = self.open_file(&path)?;
        if let Some(meta) = self.unchanged(key, &file) {
            self.stats.unread.fetch_add(1, Ordering::Relaxed);
            if self.touch_if_old(&file, meta.modified().ok()) {
                self.remember(key, &file, None);
            }
            self.count_hit(sent.bytes);
            return Some(file);
        }
        let before = self.before_check(&file);
        let (right, len) = CHECK.with_borrow_mut(|buf| {
            if buf.is_empty() {
                buf.resize(CHECK_BUFFER, 0);
            }
            // A read past the size the file should have shows one byte too many.
            let want = (sent.bytes as usize).saturating_add(1).min(CHECK_BUFFER);
            let (mut crc, mut len) = (0u32, 0u64);
            // Read at offsets: the file's position stays at its start.
            loop {
                match std::os::unix::fs::FileExt::read_at(&file, &mut buf[..want], len) {
                    Ok(0) => return (len == sent.bytes && crc == sent.crc32c, len),
                    Ok(n) if len + n as u64 <= sent.bytes => {
                        crc = batchfs::crc::crc32c_append(crc, &buf[..n]);
                        len += n as u64;
                    }
                    Ok(_) | Err(_) => return (false, len),
                }
            }
        });
        self.checked(&path, &file, key, (sent.bytes, before), right, len)?;
        Some(file)
    }

    /// Before a check read of `file`: marks it recently used if it is old (a touch moves its change time,
    /// so it comes first), and says how it is, to be remembered as checked only if it is still so after
    /// the read (a write during the read was remembered as checked, and never read again by this mount).
    fn before_check(&self, file: &std::fs::File) -> Option<Stamp> {
        self.touch_if_old(file, file.metadata().and_then(|m| m.modified()).ok());
        file.metadata().ok().map(|m| Stamp::of(&m))
    }

    /// The cache's file at `path`, opened to be read, if it is a regular file. Anything else in its place
    /// (a FIFO, whose open waited for a writer with the reader in the kernel's uninterruptible wait, a
    /// link, a directory, a device) is refused without waiting, removed where it can be, and counted
    /// corrupt: the object is fetched anew.
    fn open_file(&self, path: &Path) -> Option<std::fs::File> {
        use std::os::unix::fs::OpenOptionsExt;
        let flags = libc::O_NONBLOCK | libc::O_NOFOLLOW;
        let opened = std::fs::OpenOptions::new().read(true).custom_flags(flags).open(path);
        let regular = match opened {
            Ok(file) => file.metadata().is_ok_and(|m| m.is_file()).then_some(file),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => None,
            Err(_) => return None,
        };
        if let Some(file) = regular {
            return batchfs::fd::clear_nonblock(&file).ok().map(|()| file);
        }
        let removed = std::fs::remove_file(path).or_else(|_| std::fs::remove_dir(path)).is_ok();
        tracing::warn!(
            path = %path.display(), removed,
            "node cache: not a regular file where an object's file belongs (fetched anew)"
        );
        self.stats.corrupt.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Whether `file` (the object `key`'s) is as this mount last wrote or checked it: its metadata if so.
    fn unchanged(&self, key: Key, file: &std::fs::File) -> Option<std::fs::Metadata> {
        let was = self.checks.as_ref()?.lock().expect("checks").get(&key).copied()?;
        file.metadata().ok().filter(|m| Stamp::of(m) == was)
    }

    /// Remembers `file` (the object `key`'s, right as it is, and as `was` where that is known: how it was
    /// when it was read) where a change to it will show.
    fn remember(&self, key: Key, file: &std::fs::File, was: Option<Stamp>) {
        let Some(checks) = &self.checks else { return };
        let Ok(m) = file.metadata() else { return };
        let stamp = Stamp::of(&m);
        let mut checks = checks.lock().expect("checks");
        if stamp.size == key.sent.bytes && stamp.settled(self.fine_times) && was.is_none_or(|was| was == stamp) {
            checks.put(key, stamp);
        } else {
            checks.pop(&key);
        }
    }

    /// After a read of `file` (at `path`, `read` bytes of it) to check `hit` bytes of the object `whole`
    /// (the file as it was before the read: [`NodeCache::before_check`]): if they were `right`, remembers
    /// it as checked (the whole object read, the file unchanged since before the read) and counts the hit;
    /// else removes it and counts it corrupt (`None`: fetched anew).
    fn checked(
        &self,
        path: &Path,
        file: &std::fs::File,
        whole: Key,
        (hit, before): (u64, Option<Stamp>),
        right: bool,
        read: u64,
    ) -> Option<()> {
        if !right {
            tracing::warn!(path = %path.display(), "node cache: a corrupt file, removed (fetched anew)");
            if let Some(checks) = &self.checks {
                checks.lock().expect("checks").pop(&whole);
            }
            // Its size on the disk, not what the check read of it (it stops at the first byte too many).
            let size = file.metadata().map_or(read, |m| m.len());
            if std::fs::remove_file(path).is_ok() {
                let _ = self.used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| Some(u.saturating_sub(size)));
            }
            self.stats.corrupt.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if hit == whole.sent.bytes {
            self.remember(whole, file, before);
        }
        self.count_hit(hit);
        Some(())
    }

    /// Marks `file`, last modified at `modified` (unknown: touched), recently used if that is
    /// `touch_after` ago: whether it was touched.
    fn touch_if_old(&self, file: &std::fs::File, modified: Option<std::time::SystemTime>) -> bool {
        let now = std::time::SystemTime::now();
        let old = modified.is_none_or(|t| now.duration_since(t).is_ok_and(|age| age >= self.touch_after));
        if old {
            let _ = file.set_modified(now);
        }
        old
    }

    fn count_hit(&self, bytes: u64) {
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        self.stats.hit_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Whether the cache holds the object `key` (not checked).
    pub fn contains(&self, key: Key) -> bool {
        self.path_of(key).exists()
    }

    /// Files `data` (the verified bytes of `key`) unless it is there: written under a temporary name
    /// and renamed into place; then evicts if the cache is over its limit.
    pub fn put(&self, key: Key, data: &[u8]) -> std::io::Result<()> {
        let sent = key.sent;
        debug_assert_eq!(data.len() as u64, sent.bytes);
        if sent.bytes > self.limit {
            return Ok(());
        }
        let path = self.path_of(key);
        if path.exists() {
            return Ok(());
        }
        let dir = path.parent().expect("a file in a subdirectory");
        std::fs::create_dir_all(dir)?;
        let prefix = format!("{PART}{}-{}-", pid_namespace(), std::process::id());
        let mut tmp = tempfile::Builder::new().prefix(&prefix).tempfile_in(dir)?;
        tmp.write_all(data)?;
        // The rename moves the change time: what is remembered is the file after it.
        let file = tmp.persist(&path).map_err(|e| e.error)?;
        self.remember(key, &file, None);
        self.used.fetch_add(sent.bytes, Ordering::Relaxed);
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        self.stats.written_bytes.fetch_add(sent.bytes, Ordering::Relaxed);
        self.evict_if_full();
        Ok(())
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes in the cache, as this mount counts them.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// What it did, for the mount's stats.
    pub fn snapshot(&self) -> NodeCacheSnapshot {
        let (c, g) = (&self.stats, |a: &AtomicU64| a.load(Ordering::Relaxed));
        NodeCacheSnapshot {
            dir: self.dir.display().to_string(),
            bytes: self.used(),
            hits: g(&c.hits),
            hit_bytes: g(&c.hit_bytes),
            written_bytes: g(&c.written_bytes),
            corrupt: g(&c.corrupt),
            evictions: g(&c.evictions),
            unread: g(&c.unread),
        }
    }

    /// Every object file: its path, size and modification time. Only files named as the cache names
    /// them, in folders named so ([`is_object_file`]): whatever else a `cache_dir` given by mistake holds
    /// (`/var/lib`, a home) is neither counted nor removed, but files of two-character folders named as
    /// ours being written are and were (`.batchfs-part-...`, `.tmpXXXXXX`): those a writer killed midway
    /// left ([`left_by_the_dead`]) are removed; another writer's, in flight, are no objects.
    fn entries(&self) -> Vec<(PathBuf, u64, std::time::SystemTime)> {
        let mut out = Vec::new();
        let Ok(subdirs) = std::fs::read_dir(&self.dir) else { return out };
        for sub in subdirs.flatten() {
            let folder = sub.file_name();
            let Some(folder) = folder.to_str().filter(|f| f.len() == 2) else { continue };
            let Ok(files) = std::fs::read_dir(sub.path()) else { continue };
            for f in files.flatten() {
                let name = f.file_name();
                let Some(name) = name.to_str() else { continue };
                if !is_object_file(folder, name) {
                    let modified = f.metadata().and_then(|m| m.modified()).ok();
                    if left_by_the_dead(name, modified) && std::fs::remove_file(f.path()).is_ok() {
                        let path = f.path();
                        tracing::info!(path = %path.display(), "node cache: removed a file a writer left unfinished");
                    }
                    continue;
                }
                if let Ok(m) = f.metadata() {
                    out.push((f.path(), m.len(), m.modified().unwrap_or(std::time::UNIX_EPOCH)));
                }
            }
        }
        out
    }

    /// Past the limit: removes the least recently used files until under 90 % of it.
    fn evict_if_full(&self) {
        if self.used() <= self.limit {
            return;
        }
        let Ok(_one) = self.evicting.try_lock() else { return };
        let mut entries = self.entries();
        // Another mount's files count too: the walk is the truth.
        let mut used: u64 = entries.iter().map(|e| e.1).sum();
        entries.sort_by_key(|e| e.2);
        let target = self.limit / 10 * 9;
        for (path, size, _) in entries {
            if used <= target {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                used -= size;
                self.stats.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.used.store(used, Ordering::Relaxed);
    }
}

/// The start of the name of a file being written into the cache, before its writer's pid namespace and
/// pid.
const PART: &str = ".batchfs-part-";

/// This process's pid namespace (the inode `/proc/self/ns/pid` names; 0 where it cannot be read): a pid
/// in a part's name is looked for only by a process of the same namespace (a mount in a CSI plugin's pod
/// and `batchfs warm` in a job's may share a `cache_dir`, each seeing none of the other's processes).
fn pid_namespace() -> u64 {
    static NS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NS.get_or_init(|| {
        let link = std::fs::read_link("/proc/self/ns/pid").unwrap_or_default();
        let text = link.to_string_lossy();
        text.strip_prefix("pid:[").and_then(|t| t.strip_suffix(']')).and_then(|n| n.parse().ok()).unwrap_or(0)
    })
}

/// A file being written that no writer will finish is this old at most (a writer writes an object whole
/// from memory, then renames it into place: seconds).
const PART_LIFE: std::time::Duration = std::time::Duration::from_secs(600);

/// Whether `name`, last modified at `modified`, is a file a writer killed midway left: one of ours
/// ([`PART`]) whose writer process (of this pid namespace) is gone and that is half a minute old, or any
/// file being written (a build before named them `.tmpXXXXXX`) older than [`PART_LIFE`]. They were never
/// removed: a worker killed while warming left over a GB of them, counted by no limit.
fn left_by_the_dead(name: &str, modified: Option<std::time::SystemTime>) -> bool {
    let age = modified.and_then(|m| m.elapsed().ok()).unwrap_or_default();
    let mut fields = name.strip_prefix(PART).map(|rest| rest.splitn(3, '-'));
    let (ns, pid) = match &mut fields {
        Some(f) => (f.next().and_then(|n| n.parse::<u64>().ok()), f.next().and_then(|p| p.parse::<u32>().ok())),
        None => (None, None),
    };
    let legacy = name.len() == 10 && name.starts_with(".tmp");
    match (ns, pid) {
        (Some(ns), Some(pid)) => {
            let seen = ns != 0 && ns == pid_namespace();
            let gone = seen && !Path::new("/proc").join(pid.to_string()).exists();
            (gone && age >= std::time::Duration::from_secs(30)) || age >= PART_LIFE
        }
        _ => (fields.is_some() || legacy) && age >= PART_LIFE,
    }
}

/// Whether `name` in folder `folder` is an object file as [`NodeCache::path_of`] names them (`CRC-SIZE-ID`,
/// or `CRC-SIZE` of a build before objects had names), `CRC` eight hex digits whose first two are the folder.
fn is_object_file(folder: &str, name: &str) -> bool {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let mut parts = name.split('-');
    let (crc, size, id) = (parts.next(), parts.next(), parts.next());
    let crc_ok = crc.is_some_and(|c| hex(c, 8) && c.starts_with(folder));
    let size_ok = size.is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()));
    crc_ok && size_ok && id.is_none_or(|i| hex(i, 16)) && parts.next().is_none()
}

/// Whether a write right after a look at a file moves its change time in `dir`'s filesystem (multigrain
/// timestamps: ext4, XFS, Btrfs and tmpfs since Linux 6.13), asked of a scratch file: each of a few writes
/// made at once after a `stat` must show, all within a millisecond (a filesystem slower than that could
/// show a tick's change between its calls and still hide one within a tick). On a filesystem whose times
/// are a tick coarse, most do not.
fn changes_show_at_once(dir: &Path) -> bool {
    let started = std::time::Instant::now();
    let probe = || -> std::io::Result<bool> {
        let mut f = tempfile::tempfile_in(dir)?;
        let mut was = Stamp::of(&f.metadata()?);
        for _ in 0..16 {
            f.write_all(b"x")?;
            let now = Stamp::of(&f.metadata()?);
            if now.ctime == was.ctime {
                return Ok(false);
            }
            was = now;
        }
        Ok(started.elapsed() < std::time::Duration::from_millis(1))
    };
    let fine = probe().unwrap_or(false);
    tracing::debug!(dir = %dir.display(), fine, "node cache: whether a change shows in the change time at once");
    fine
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// `data` as the node cache files it, as object 1 of its dataset (the tests' objects differ by
    /// contents; one test below names two objects of the same contents).
    fn sent(data: &[u8]) -> Key {
        Key { sent: Sent { bytes: data.len() as u64, crc32c: batchfs::crc::crc32c(data) }, id: 1 }
    }

    /// A `cache_dir` that is a file is refused as such, and one that is a link to nothing as that (each
    /// said "File exists" before).
    #[test]
    fn a_cache_dir_that_is_a_file_is_refused_as_not_a_directory() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let e = NodeCache::open(file.path(), 1 << 20, "d").err().unwrap();
        assert_eq!(e.to_string(), "it is not a directory");
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("cache");
        std::os::unix::fs::symlink(dir.path().join("nvme-not-mounted"), &link).unwrap();
        let e = NodeCache::open(&link, 1 << 20, "d").err().unwrap();
        assert!(e.to_string().contains("nvme-not-mounted, which does not exist"), "{e}");
    }

    fn eventually(what: &str, done: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn objects_are_kept_by_content_and_checked_at_every_read() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), 1 << 20, "d").unwrap();
        let (a, b) = (b"the first object".to_vec(), b"another".to_vec());
        assert_eq!(cache.get(sent(&a)), None);
        cache.put(sent(&a), &a).unwrap();
        cache.put(sent(&b), &b).unwrap();
        assert_eq!(cache.get(sent(&a)), Some(a.clone()));
        // A second cache over the same directory (another mount, or this one remounted) finds them.
        let again = NodeCache::open(dir.path(), 1 << 20, "d").unwrap();
        assert_eq!(again.get(sent(&b)), Some(b.clone()));
        eventually("the walk counts what is there", || again.used() == (a.len() + b.len()) as u64);
        // A file flipped on disk is refused, removed, and counted.
        let path = cache.path_of(sent(&a));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[3] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(cache.get(sent(&a)), None);
        assert!(!path.exists());
        assert_eq!(cache.stats.corrupt.load(Ordering::Relaxed), 1);
        // A truncated one too.
        let path = cache.path_of(sent(&b));
        std::fs::write(&path, &b[..3]).unwrap();
        assert_eq!(cache.get(sent(&b)), None);
    }

    /// Files a writer killed midway left are removed by the next walk (a mount's start, an eviction):
    /// a dead writer's once half a minute old, anyone's once [`PART_LIFE`] old; a live writer's and
    /// files of other names are left alone.
    #[test]
    fn files_left_unfinished_by_killed_writers_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("ab");
        std::fs::create_dir_all(&folder).unwrap();
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        let ancient = std::time::SystemTime::now() - PART_LIFE - std::time::Duration::from_secs(1);
        let write = |name: &str, at: std::time::SystemTime| {
            let path = folder.join(name);
            std::fs::write(&path, b"half an object").unwrap();
            std::fs::File::options().write(true).open(&path).unwrap().set_modified(at).unwrap();
            path
        };
        let ns = pid_namespace();
        let dead = write(&format!("{PART}{ns}-999999999-aB3xYz"), old);
        let live = write(&format!("{PART}{ns}-{}-q1w2e3", std::process::id()), old);
        let live_ancient = write(&format!("{PART}{ns}-{}-r4t5y6", std::process::id()), ancient);
        let dead_new = write(&format!("{PART}{ns}-999999999-u7i8o9"), std::time::SystemTime::now());
        // Of another pid namespace: its writer cannot be looked for here; only its age tells.
        let elsewhere = write(&format!("{PART}{}-999999999-p0o9i8", ns + 1), old);
        let elsewhere_ancient = write(&format!("{PART}{}-999999999-l1k2j3", ns + 1), ancient);
        let legacy = write(".tmpAbC123", ancient);
        let legacy_new = write(".tmpDeF456", old);
        let someone_else = write("notes.txt", ancient);
        let cache = NodeCache::open(dir.path(), 1 << 20, "d").unwrap();
        let gone = [&dead, &legacy, &live_ancient, &elsewhere_ancient];
        eventually("the walk at open removes them", || gone.iter().all(|p| !p.exists()));
        assert!(live.exists() && dead_new.exists() && legacy_new.exists() && someone_else.exists());
        assert!(elsewhere.exists(), "a writer of another namespace is not taken for dead");
        assert_eq!(cache.used(), 0, "nothing counted");
    }

    /// A FIFO, a link or a directory where an object's file belongs is refused at once, removed and
    /// counted corrupt, and the object can be kept again. A FIFO's open waited for a writer: the reader
    /// hung in the kernel, past any signal.
    #[test]
    fn what_is_no_regular_file_in_an_object_s_place_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), 1 << 20, "d").unwrap();
        let a = b"an object of the dataset".to_vec();
        let path = cache.path_of(sent(&a));
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, &a).unwrap();
        let cases: [(&str, &dyn Fn()); 3] = [
            ("a FIFO", &|| assert_eq!(mkfifo(&path), 0)),
            ("a link", &|| std::os::unix::fs::symlink(&elsewhere, &path).unwrap()),
            ("a directory", &|| std::fs::create_dir(&path).unwrap()),
        ];
        for (n, (what, make)) in cases.iter().enumerate() {
            cache.put(sent(&a), &a).unwrap();
            std::fs::remove_file(&path).unwrap();
            make();
            let (tx, rx) = std::sync::mpsc::channel();
            let c = cache.clone();
            let key = sent(&a);
            std::thread::spawn(move || tx.send((c.get(key), c.open_checked(key).is_some())).unwrap());
            let got = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap_or_else(|_| panic!("{what}: hung"));
            assert_eq!(got, (None, false), "{what}");
            assert!(std::fs::symlink_metadata(&path).is_err(), "{what} removed");
            assert_eq!(cache.stats.corrupt.load(Ordering::Relaxed), n as u64 + 1, "{what} counted once");
            cache.put(sent(&a), &a).unwrap();
            assert_eq!(cache.get(sent(&a)), Some(a.clone()), "{what}: kept again");
            assert_eq!(std::fs::read(&elsewhere).unwrap(), a, "what a link led to is left alone");
        }
    }

    /// A FIFO made at `path` by mkfifo(1) (no unsafe code in tests): its status code.
    fn mkfifo(path: &Path) -> i32 {
        std::process::Command::new("mkfifo").arg(path).status().unwrap().code().unwrap_or(-1)
    }

    /// Two objects of one size and CRC32C (which a check cannot tell apart) are two files: each object's
    /// name is its own, and a cache of another dataset over the same directory has names of its own. One
    /// file for both served one's bytes for the other.
    #[test]
    fn objects_of_one_size_and_crc_are_kept_apart_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), 1 << 20, "d").unwrap();
        let a = b"an object".to_vec();
        let (first, second) = (Key { id: 1, ..sent(&a) }, Key { id: 2, ..sent(&a) });
        cache.put(first, &a).unwrap();
        assert!(cache.contains(first) && !cache.contains(second));
        assert_eq!(cache.get(second), None, "another object of the same size and CRC is not this one");
        let other = NodeCache::open(dir.path(), 1 << 20, "e").unwrap();
        assert!(!other.contains(first), "the same object of another dataset is not this one");
        assert_eq!(NodeCache::open(dir.path(), 1 << 20, "d").unwrap().get(first), Some(a), "a new mount's name");
        // Names every process makes alike: a stable hash, not one seeded per process.
        assert_eq!(ident(&[b"sample", &7u32.to_le_bytes()]), ident(&[b"sample", &7u32.to_le_bytes()]));
        assert_ne!(ident(&[b"ab", b"c"]), ident(&[b"a", b"bc"]));
        assert_eq!(ident(&[]), 0xcbf2_9ce4_8422_2325, "FNV-1a's offset basis");
    }

    /// A `cache_dir` given where other files are (a mistake: `/var/lib`, a home) has only the cache's own
    /// files counted and evicted: the walk removed every file of every folder below it, oldest first.
    #[test]
    fn eviction_removes_only_the_cache_s_own_files() {
        let dir = tempfile::tempdir().unwrap();
        let theirs =
            [dir.path().join("ab/notes.txt"), dir.path().join("etc/passwd"), dir.path().join("ab/ab12cd34-5.txt")];
        for path in &theirs {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, vec![b'x'; 600]).unwrap();
        }
        let old = dir.path().join("00/00112233-600");
        std::fs::create_dir_all(old.parent().unwrap()).unwrap();
        std::fs::write(&old, vec![b'y'; 600]).unwrap();
        let cache = NodeCache::open(dir.path(), 1000, "d").unwrap();
        eventually("the walk counts the old build's file only", || cache.used() == 600);
        let a = vec![b'z'; 700];
        cache.put(sent(&a), &a).unwrap();
        assert!(!old.exists(), "an object file of the cache's (an older build's name) evicted");
        assert!(theirs.iter().all(|p| p.exists()), "other files left alone");
        assert!(is_object_file("ab", "ab12cd34-5-0123456789abcdef") && is_object_file("ab", "ab12cd34-5"));
        for (folder, name) in [("ab", "cd12cd34-5"), ("ab", "ab12cd34"), ("ab", "ab12cd34-5-x"), ("ab", "AB12CD34-5")] {
            assert!(!is_object_file(folder, name), "{folder}/{name}");
        }
    }

    /// A file handed to the kernel is checked like a read: whole and right, or removed; a longer one too.
    #[test]
    fn files_opened_for_the_kernel_are_checked_first() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), 16 << 20, "d").unwrap();
        // Larger than the check's buffer: read in pieces.
        let a: Vec<u8> = (0..(3 << 20) + 5).map(|i| (i % 251) as u8).collect();
        assert!(cache.open_checked(sent(&a)).is_none(), "not there");
        cache.put(sent(&a), &a).unwrap();
        let mut got = Vec::new();
        cache.open_checked(sent(&a)).expect("there and right").read_to_end(&mut got).unwrap();
        assert!(got == a, "the whole object, from the start");
        assert_eq!(cache.stats.hits.load(Ordering::Relaxed), 1);
        let path = cache.path_of(sent(&a));
        for wrong in [&a[..a.len() - 1], &[&a[..], b"x"].concat()[..], &[&[a[0] ^ 1], &a[1..]].concat()[..]] {
            std::fs::write(&path, wrong).unwrap();
            assert!(cache.open_checked(sent(&a)).is_none(), "a wrong file of {} bytes", wrong.len());
            assert!(!path.exists(), "removed");
        }
        assert_eq!(cache.stats.corrupt.load(Ordering::Relaxed), 3);
        assert_eq!(cache.used(), 0, "each removal counted at the size it had on the disk, never below 0");
        let empty = sent(b"");
        cache.put(empty, b"").unwrap();
        assert!(cache.open_checked(empty).is_some(), "an empty object is right");
    }

    /// A file this mount wrote or checked opens without being read again while its inode is as it was;
    /// a byte changed in place (its modification time even set back) or a file renamed over it is read
    /// and checked again. With no checks remembered, every open reads.
    #[test]
    fn a_file_checked_once_is_read_again_only_once_it_changed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), 1 << 30, "d").unwrap();
        let unread = || cache.stats.unread.load(Ordering::Relaxed);
        let a: Vec<u8> = (0..300_000u32).map(|i| (i * 13 % 251) as u8).collect();
        cache.put(sent(&a), &a).unwrap();
        // Older than a tick of the coarsest clock: remembered however fine the filesystem's times are.
        std::thread::sleep(SETTLED);
        for _ in 0..3 {
            let mut got = Vec::new();
            cache.open_checked(sent(&a)).expect("right").read_to_end(&mut got).unwrap();
            assert!(got == a);
        }
        assert!(unread() >= 2, "checked at most once: {} unread of 3", unread());
        assert_eq!(cache.stats.hits.load(Ordering::Relaxed), 3);

        // One byte flipped in place, the modification time put back as it was: the change time moved.
        let path = cache.path_of(sent(&a));
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        let f = std::fs::File::options().write(true).open(&path).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[a[1000] ^ 1], 1000).unwrap();
        f.set_modified(mtime).unwrap();
        drop(f);
        let before = unread();
        assert!(cache.open_checked(sent(&a)).is_none(), "a file changed in place is read, and found wrong");
        assert!(!path.exists(), "removed");
        assert_eq!(unread(), before);

        // Written again, then another copy renamed over it (a new inode): read again, right, remembered.
        cache.put(sent(&a), &a).unwrap();
        std::thread::sleep(SETTLED);
        let mut other = tempfile::NamedTempFile::new_in(path.parent().unwrap()).unwrap();
        other.write_all(&a).unwrap();
        other.persist(&path).unwrap();
        std::thread::sleep(SETTLED);
        let before = unread();
        assert!(cache.open_checked(sent(&a)).is_some());
        assert_eq!(unread(), before, "a file renamed over the one remembered is read");
        assert!(cache.open_checked(sent(&a)).is_some());
        assert_eq!(unread(), before + 1, "and remembered once checked");

        // Remembering nothing: every open reads.
        let none = NodeCache::open_remembering(dir.path(), 1 << 30, 0, "d").unwrap();
        for _ in 0..2 {
            assert!(none.open_checked(sent(&a)).is_some());
        }
        assert_eq!(none.stats.unread.load(Ordering::Relaxed), 0);
    }

    /// A file written in place during its check read was remembered as checked (its stamp taken after the
    /// read) and never read again by the mount: it is remembered only as it was before the read.
    #[test]
    fn a_file_written_during_its_check_is_not_remembered_as_checked() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), 1 << 30, "d").unwrap();
        let a: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        cache.put(sent(&a), &a).unwrap();
        std::thread::sleep(SETTLED);
        let path = cache.path_of(sent(&a));
        // The check read found it right; a write came before the stamp was taken.
        let file = cache.open_file(&path).unwrap();
        cache.checks.as_ref().unwrap().lock().unwrap().pop(&sent(&a));
        let before = cache.before_check(&file);
        let w = std::fs::File::options().write(true).open(&path).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&w, &[a[10] ^ 1], 10).unwrap();
        drop(w);
        std::thread::sleep(SETTLED);
        cache.checked(&path, &file, sent(&a), (a.len() as u64, before), true, a.len() as u64).unwrap();
        let unread = cache.stats.unread.load(Ordering::Relaxed);
        assert!(cache.open_checked(sent(&a)).is_none(), "read again, and found wrong");
        assert_eq!(cache.stats.unread.load(Ordering::Relaxed), unread);
        assert!(!path.exists());
    }

    /// A part of a file kept whole is read alone and checked against its own CRC: the file at another
    /// size, a wrong part, or a part past the end is no hit, and a wrong file is removed.
    #[test]
    fn parts_of_a_whole_file_are_read_alone_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), 1 << 30, "d").unwrap();
        let whole: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        cache.put(sent(&whole), &whole).unwrap();
        let part = |at: usize, len: usize| sent(&whole[at..at + len]).sent;
        assert_eq!(cache.get_part(sent(&whole), 4000, part(4000, 3000)).as_deref(), Some(&whole[4000..7000]));
        assert_eq!(cache.stats.hit_bytes.load(Ordering::Relaxed), 3000, "the part's bytes are the hit's");
        assert_eq!(cache.get_part(sent(&whole), 9000, part(9000, 1000)).as_deref(), Some(&whole[9000..]));
        let past = Sent { bytes: 2000, crc32c: 0 };
        assert_eq!(cache.get_part(sent(&whole), 9000, past), None, "past the end: asked wrong, not a wrong file");
        assert!(cache.contains(sent(&whole)));
        assert_eq!(cache.get_part(sent(&whole), 0, part(1, 100)), None, "another part's CRC");
        assert!(!cache.contains(sent(&whole)), "a file whose part is wrong is removed");
        cache.put(sent(&whole), &whole).unwrap();
        std::fs::write(cache.path_of(sent(&whole)), &whole[..9999]).unwrap();
        assert_eq!(cache.get_part(sent(&whole), 0, part(0, 100)), None, "the file one byte short");
        assert!(!cache.contains(sent(&whole)));
        assert_eq!(cache.stats.corrupt.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn the_least_recently_used_go_past_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open_with(dir.path(), 1000, DEFAULT_CHECKS, std::time::Duration::ZERO, "d").unwrap();
        let objects: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 300]).collect();
        for (i, o) in objects.iter().enumerate() {
            cache.put(sent(o), o).unwrap();
            // Distinct times, the first used again after the third was written.
            std::thread::sleep(std::time::Duration::from_millis(20));
            if i == 2 {
                assert!(cache.get(sent(&objects[0])).is_some());
            }
        }
        assert!(cache.used() <= 1000, "{}", cache.used());
        let kept: Vec<bool> = objects.iter().map(|o| cache.contains(sent(o))).collect();
        assert_eq!(
            kept,
            [true, false, false, true, true],
            "the first was used after the third: the second and third went"
        );
        assert!(cache.stats.evictions.load(Ordering::Relaxed) >= 2);
        // An object larger than the whole cache is not kept.
        let big = vec![9u8; 2000];
        cache.put(sent(&big), &big).unwrap();
        assert!(!cache.contains(sent(&big)));
    }

    #[test]
    fn a_hit_touches_a_file_only_once_it_is_old() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), 1 << 20, "d").unwrap();
        let o = vec![7u8; 3000];
        cache.put(sent(&o), &o).unwrap();
        let path = cache.path_of(sent(&o));
        let mtime = || std::fs::metadata(&path).unwrap().modified().unwrap();
        let old = std::time::SystemTime::now() - TOUCH_AFTER - std::time::Duration::from_secs(1);
        std::fs::File::options().write(true).open(&path).unwrap().set_modified(old).unwrap();
        assert!(cache.open_checked(sent(&o)).is_some());
        let touched = mtime();
        assert!(touched > old, "an old file is touched by a hit");
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(cache.open_checked(sent(&o)).is_some());
        assert_eq!(mtime(), touched, "a file touched a moment ago is not touched again");
        // The check's buffer, reused by this thread, is as long as the largest file it checked before.
        let big = vec![3u8; 5000];
        cache.put(sent(&big), &big).unwrap();
        assert!(cache.open_checked(sent(&big)).is_some());
        assert!(cache.open_checked(sent(&o)).is_some(), "a smaller file after a larger one");
    }
}
