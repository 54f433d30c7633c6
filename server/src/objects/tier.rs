//! The disk tier (`disk_cache`): whole objects of object datasets kept on the server's local disks, so a
//! dataset larger than the server's memory is read from the store once and then from local disk.
//!
//! **Layout.** `DIR/objects/NAME` holds one object's bytes, whole. `NAME` is `K-E`: `K` the MD5 (hex)
//! of the object's endpoint, bucket and key, `E` the first 16 hex digits of the MD5 of its ETag, so a
//! rewritten object (a new ETag) is never found under its old copy's name, and the old copy is found
//! (by `K`) and removed when the new one is staged. `DIR/staging/` holds copies being written.
//!
//! **Only checked copies reach their name.** A copy is written under `staging/`, checked, and then
//! renamed into `objects/` ([`Staging::commit`]); a copy that is dropped unfinished is removed. Copies
//! made to serve are checked chunk by chunk (4 MiB) against the index's CRC32Cs; copies made while
//! indexing (before there is an index) against the object's ETag where that is an MD5, and the index is
//! then computed from the copy itself. A server killed while staging leaves files under `staging/` only,
//! and the next start removes them ([`Tier::open`]). Copies found at start are read whole and checked
//! against the index before each is first served (a crash or a disk may have changed them since; so no
//! `fsync` is needed to keep a wrong byte out): see `Entry::checked`. Such a copy is checked once
//! ([`Tier::checked_copy`]: one caller reads it in 4 MiB pieces, the others for it wait for the verdict),
//! by a read on the blocking pool; the paths that run on the runtime's workers (a body's mapped and direct
//! reads) take only copies checked already ([`Tier::is_unchecked`]) and leave the others to that read.
//!
//! **Room.** The tier holds at most `disk_cache_size` bytes of disk (auto: 90 % of what its filesystem has
//! free at start, plus what the tier already holds), copies being written counted from their start; the
//! least recently used copies are evicted to make room. A copy counts what it occupies on the disk, its
//! size rounded up to the filesystem's block ([`Tier::on_disk`]; found again at start, the same): counted
//! by their sizes, 1,398 copies of a few bytes under a cap of 2 MiB took 5.9 MB. At start, what is found
//! is ordered by modification time, oldest first to go. A copy evicted while a read has it open is read to the end
//! (the kernel keeps an unlinked file for its open descriptors).
//!
//! **Copies let go while open.** An evicted (or removed) copy's disk is freed only when the last mapping or
//! descriptor of it goes, so the tier counts it until then: whoever opens a copy says so
//! ([`Tier::opened`], a weak reference the tier looks at), and a copy let go while one is alive moves to
//! `gone`, counted beside the copies held and those being written; a copy that does not fit beside them
//! waits its turn (`WouldBlock`) rather than take the disk past the cap. What keeps copies open between
//! reads (a dataset's mapped and opened copies, `maps.rs`) registers as a [`Keeper`] and is told of each
//! copy let go at once, so an evicted copy stays open only as long as the bodies reading it. (Before, kept
//! copies were let go only when next looked up: a server whose mounts had gone held 158 evicted copies
//! mapped, and the disk held 2.4 times the cap, `No space left on device`.)
//!
//! A failing disk (a write or `fsync` that fails, a full filesystem) loses the copy being written, is
//! logged and counted, and the object is read from the store as if the tier were not there.

use lru::LruCache;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};

/// Why the tier cannot be used: each says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("disk_cache {dir}: cannot create it ({source})")]
    Create { dir: PathBuf, source: io::Error },
    #[error("disk_cache {dir}: cannot write there ({source}): give a writable directory on a local disk")]
    NotWritable { dir: PathBuf, source: io::Error },
    #[error("disk_cache {dir}: cannot read what it holds ({source})")]
    Scan { dir: PathBuf, source: io::Error },
    #[error("disk_cache {dir}: its filesystem has no room ({free} bytes free): free some, or set disk_cache_size")]
    NoRoom { dir: PathBuf, free: u64 },
    #[error("disk_cache {dir}: disk_cache_size is 0; give the tier room (e.g. 100G), or leave disk_cache out")]
    Zero { dir: PathBuf },
    #[error("disk_cache {dir}: another server uses it (pid in {dir}/lock); give each server a directory of its own")]
    InUse { dir: PathBuf },
}

/// `DIR/lock`, locked with this process's pid written in it: a POSIX record lock (`F_SETLK`, not waited
/// for), the process's own, so another process is refused while this one opens its tier again as often as
/// it likes (its tests do); let go when the process ends however it ends.
fn lock(dir: &Path) -> io::Result<File> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let path = dir.join("lock");
    let mut file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
    // SAFETY: an all-zero `flock` is a valid value; the fields set below make it a write lock of the
    // whole file.
    let mut whole: libc::flock = unsafe { std::mem::zeroed() };
    whole.l_type = libc::F_WRLCK as _;
    whole.l_whence = libc::SEEK_SET as _;
    // SAFETY: fcntl reads the struct through the pointer, which outlives the call, on a descriptor this
    // function holds open.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLK, &whole) } != 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EACCES) => io::Error::from_raw_os_error(libc::EWOULDBLOCK),
            _ => e,
        });
    }
    file.set_len(0)?;
    writeln!(file, "{}", std::process::id())?;
    Ok(file)
}

/// What the tier did, counted (exported at `/metrics`).
#[derive(Debug, Default)]
pub struct TierCounters {
    /// Reads served from a copy in the tier, and their bytes.
    pub hits: AtomicU64,
    pub hit_bytes: AtomicU64,
    /// Objects copied into the tier, and the bytes read from the store to copy them.
    pub staged: AtomicU64,
    pub fetched_bytes: AtomicU64,
    /// Copies evicted to make room.
    pub evicted: AtomicU64,
    /// Copies lost to a failing disk, or found differing from the index and removed.
    pub failures: AtomicU64,
    /// Ranges of copies rechecked because a client found a body from them failing its checksum
    /// (`objects/recheck.rs`), copies dropped for it (their bytes differed from the index: counted in
    /// `failures` too), and rechecks refused (as many running as the server allows).
    pub rechecked: AtomicU64,
    pub recheck_dropped: AtomicU64,
    pub recheck_refused: AtomicU64,
}

/// One copy in the tier.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Bytes of disk it occupies ([`Tier::on_disk`] of its size).
    size: u64,
    /// Checked against the index in this process (staged here, or read and checked once since start).
    checked: bool,
}

/// Something that keeps copies of the tier open between reads (a dataset's mapped or opened copies):
/// told of each copy the tier lets go, it lets go of it too, so that the copy's disk is freed once the
/// reads of it end. Told with the tier's lock held: it must never call the tier while holding its own.
pub trait Keeper: Send + Sync {
    /// Lets go of copy `name` (evicted, or removed).
    fn let_go(&self, name: &str);
}

/// A mapping or an open file of a copy, as the tier sees it: alive while its holder keeps it.
pub type Opened = Weak<dyn std::any::Any + Send + Sync>;

/// Whether any of `opened` is alive still (what is dead is dropped).
fn alive(opened: &mut Vec<Opened>) -> bool {
    opened.retain(|o| o.strong_count() > 0);
    !opened.is_empty()
}

struct Inner {
    entries: LruCache<String, Entry>,
    /// Bytes of disk the copies in `entries` occupy.
    bytes: u64,
    /// Bytes of disk of the copies being written.
    reserved: u64,
    /// The mappings and files of each copy held, opened by its readers ([`Tier::opened`]).
    open: HashMap<String, Vec<Opened>>,
    /// Copies let go while open, with what each occupies: on the disk until the last of them is closed.
    gone: Vec<(u64, Vec<Opened>)>,
    /// Bytes of disk the copies in `gone` occupy.
    gone_bytes: u64,
}

impl Inner {
    /// Forgets the copies let go whose last mapping or file is closed: their disk is free.
    fn settle(&mut self) {
        let mut freed = 0;
        self.gone.retain_mut(|(size, opened)| {
            alive(opened) || {
                freed += *size;
                false
            }
        });
        self.gone_bytes -= freed;
    }

    /// Bytes of disk the tier takes: its copies, those being written, those let go but open.
    fn taken(&self) -> u64 {
        self.bytes + self.reserved + self.gone_bytes
    }
}

/// The disk tier of a server, shared by its object datasets.
pub struct Tier {
    dir: PathBuf,
    objects: PathBuf,
    staging: PathBuf,
    cap: u64,
    /// The filesystem's block (`statvfs`'s `f_frsize`): what a file's size is rounded up to on its disk.
    block: u64,
    inner: Mutex<Inner>,
    /// Copies found at start being checked now: another reader of one waits for its verdict
    /// ([`Tier::checked_copy`]). Taken before `inner`, never after.
    checking: Mutex<HashSet<String>>,
    verdict: Condvar,
    /// What keeps copies open between reads, told of each copy let go. Taken after `inner`.
    keepers: Mutex<Vec<Weak<dyn Keeper>>>,
    /// The threads that checked copies, in order (the tests look at who did).
    #[cfg(test)]
    pub(super) checked_by: Mutex<Vec<std::thread::ThreadId>>,
    seq: AtomicU64,
    pub counters: TierCounters,
    /// Lost copies' warnings (a full or failing disk loses every copy it is given).
    lost_log: super::Throttled,
    /// `DIR/lock`, locked while the tier is open: one server a directory.
    _lock: File,
}

impl Tier {
    /// Opens the tier in `dir` (made if missing), removes what a server killed while staging left, and
    /// takes the copies found as the least recently used first (oldest modification time first). `size`:
    /// the most bytes it holds.
    pub fn open(dir: &Path, size: crate::policy::AutoSize) -> Result<Tier, TierError> {
        if size == crate::policy::AutoSize::Bytes(0) {
            return Err(TierError::Zero { dir: dir.to_owned() });
        }
        let objects = dir.join("objects");
        let staging = dir.join("staging");
        let not_writable = |source| TierError::NotWritable { dir: dir.to_owned(), source };
        for d in [&objects, &staging] {
            std::fs::create_dir_all(d).map_err(|source| match dir.is_dir() {
                true => not_writable(source),
                false => TierError::Create { dir: dir.to_owned(), source },
            })?;
        }
        let probe = staging.join(format!(".probe-{}", std::process::id()));
        std::fs::write(&probe, b"batchfs").map_err(not_writable)?;
        std::fs::remove_file(&probe).map_err(not_writable)?;
        // One server a directory: a second one's start would remove the first's copies being made.
        let lock = lock(dir).map_err(|e| match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => TierError::InUse { dir: dir.to_owned() },
            _ => not_writable(e),
        })?;
        let scan = |source| TierError::Scan { dir: dir.to_owned(), source };
        let mut left = 0;
        for entry in std::fs::read_dir(&staging).map_err(scan)? {
            let entry = entry.map_err(scan)?;
            // Copies being made, and indexing's directories of links to them.
            let path = entry.path();
            if std::fs::remove_file(&path).or_else(|_| std::fs::remove_dir_all(&path)).is_ok() {
                left += 1;
            }
        }
        if left > 0 {
            tracing::info!(dir = %dir.display(), files = left, "disk tier: removed copies left unfinished");
        }
        let (free, block) = room(dir).map_err(scan)?;
        let on_disk = |size: u64| size.div_ceil(block) * block;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&objects).map_err(scan)? {
            let entry = entry.map_err(scan)?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let meta = entry.metadata().map_err(scan)?;
            if !meta.is_file() || !is_name(&name) {
                tracing::warn!(dir = %dir.display(), %name, "disk tier: not a copy of ours, left alone");
                continue;
            }
            let mtime = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
            // Counted as a copy staged now is: its size rounded up to the block.
            found.push((mtime, name, on_disk(meta.len())));
        }
        found.sort();
        let held: u64 = found.iter().map(|f| f.2).sum();
        let cap = match size {
            crate::policy::AutoSize::Bytes(n) => n,
            crate::policy::AutoSize::Auto => (free + held) / 10 * 9,
        };
        if cap == 0 {
            return Err(TierError::NoRoom { dir: dir.to_owned(), free });
        }
        if past_the_disk(cap, free, held) {
            tracing::warn!(
                dir = %dir.display(), disk_cache_size = cap, free, held,
                "disk tier: disk_cache_size is more than its filesystem has free and the copies held: once the \
                 disk is full, a copy that cannot be written is dropped and read from the store instead"
            );
        }
        let mut entries = LruCache::unbounded();
        for (_, name, size) in found {
            entries.put(name, Entry { size, checked: false });
        }
        let tier = Tier {
            dir: dir.to_owned(),
            objects,
            staging,
            cap,
            block,
            inner: Mutex::new(Inner {
                entries,
                bytes: held,
                reserved: 0,
                open: HashMap::new(),
                gone: Vec::new(),
                gone_bytes: 0,
            }),
            checking: Mutex::new(HashSet::new()),
            verdict: Condvar::new(),
            keepers: Mutex::new(Vec::new()),
            #[cfg(test)]
            checked_by: Mutex::new(Vec::new()),
            seq: AtomicU64::new(0),
            counters: TierCounters::default(),
            lost_log: super::Throttled::default(),
            _lock: lock,
        };
        tier.make_room(&mut tier.inner.lock().expect("tier"), 0);
        let inner = tier.inner.lock().expect("tier");
        tracing::info!(
            dir = %dir.display(), cap, copies = inner.entries.len(), bytes = inner.bytes, "disk tier opened"
        );
        drop(inner);
        Ok(tier)
    }

    /// The name of the copy of `key` (endpoint, bucket and key) with `etag`.
    pub fn name(key: &str, etag: &str) -> String {
        use md5::Digest;
        let k = md5::Md5::digest(key.as_bytes());
        let e = md5::Md5::digest(etag.as_bytes());
        let mut name = String::with_capacity(49);
        hex_into(&mut name, &k);
        name.push('-');
        hex_into(&mut name, &e[..8]);
        name
    }

    /// The most bytes the tier holds.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Bytes of disk a copy of `size` bytes occupies: its size rounded up to the filesystem's block (what
    /// the tier counts of each copy, so that `disk_cache_size` bounds the disk used).
    pub fn on_disk(&self, size: u64) -> u64 {
        size.div_ceil(self.block) * self.block
    }

    /// Bytes of disk the copies it holds occupy.
    pub fn bytes(&self) -> u64 {
        self.inner.lock().expect("tier").bytes
    }

    /// Bytes of disk of the copies let go (evicted or removed) that a mapping or a file holds open still:
    /// on the disk until closed, and counted against the cap until then.
    pub fn gone_bytes(&self) -> u64 {
        let mut inner = self.inner.lock().expect("tier");
        inner.settle();
        inner.gone_bytes
    }

    /// Registers `keeper`, told from now on of each copy the tier lets go ([`Keeper`]).
    pub fn keep_with(&self, keeper: Weak<dyn Keeper>) {
        let mut keepers = self.keepers.lock().expect("tier keepers");
        keepers.retain(|k| k.strong_count() > 0);
        keepers.push(keeper);
    }

    /// Records that copy `name` is opened (mapped, or a file) by `by`, so that, let go while `by` is alive,
    /// it is counted until `by` is dropped. Returns whether the tier holds the copy: where it does not
    /// (evicted meanwhile), the caller keeps nothing of it.
    pub fn opened(&self, name: &str, by: Opened) -> bool {
        let mut inner = self.inner.lock().expect("tier");
        if !inner.entries.contains(name) {
            return false;
        }
        let opened = inner.open.entry(name.to_owned()).or_default();
        alive(opened);
        opened.push(by);
        true
    }

    /// How many copies it holds.
    pub fn copies(&self) -> usize {
        self.inner.lock().expect("tier").entries.len()
    }

    /// Where the tier is.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether copy `name` is held (not counted as a use).
    pub fn contains(&self, name: &str) -> bool {
        self.inner.lock().expect("tier").entries.contains(name)
    }

    /// Whether the tier holds copy `name`, counted as used (a read of its mapping): the copies being
    /// read are the last evicted.
    pub fn used(&self, name: &str) -> bool {
        self.inner.lock().expect("tier").entries.get(name).is_some()
    }

    /// Has copy `name` evicted before every other (its dataset will not read it for a while): copies so
    /// marked go in the order marked, the latest first.
    pub fn demote(&self, name: &str) {
        self.inner.lock().expect("tier").entries.demote(name);
    }

    /// Copy `name`, counted as used: its path and whether it was checked in this process.
    pub fn get(&self, name: &str) -> Option<(PathBuf, bool)> {
        let mut inner = self.inner.lock().expect("tier");
        let entry = *inner.entries.get(name)?;
        Some((self.objects.join(name), entry.checked))
    }

    /// Whether the tier holds copy `name` not yet checked in this process (found at start): not counted
    /// as a use, and never waits for a check. For the runtime's workers, which must not check it.
    pub fn is_unchecked(&self, name: &str) -> bool {
        self.inner.lock().expect("tier").entries.peek(name).is_some_and(|e| !e.checked)
    }

    /// Copy `name`'s path, counted as used, once it is checked: a copy found at start and not checked yet
    /// is checked now by `check` (given its path), by one caller while the others for the same copy wait
    /// for the verdict, and removed where `check` fails (its error the reason logged). `None` where the
    /// tier does not hold the copy (or no longer). Blocks for as long as a check: call on the blocking pool.
    pub fn checked_copy(&self, name: &str, check: impl FnOnce(&Path) -> io::Result<()>) -> Option<PathBuf> {
        let mut checking = self.checking.lock().expect("tier checking");
        let path = loop {
            // Looked at with `checking` held: a check marks its copy (or removes it) before it leaves
            // `checking`, so a copy is checked, being checked, or this caller's to check.
            match self.get(name)? {
                (path, true) => return Some(path),
                (path, false) if checking.insert(name.to_owned()) => break path,
                _ => checking = self.verdict.wait(checking).expect("tier checking"),
            }
        };
        drop(checking);
        // Leaves `checking` and wakes the waiters however the check ends (a panic included).
        struct Done<'a>(&'a Tier, &'a str);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.checking.lock().expect("tier checking").remove(self.1);
                self.0.verdict.notify_all();
            }
        }
        let _done = Done(self, name);
        #[cfg(test)]
        self.checked_by.lock().expect("checked by").push(std::thread::current().id());
        match check(&path) {
            Ok(()) => {
                self.mark_checked(name);
                Some(path)
            }
            Err(e) => {
                self.remove(name, &e.to_string());
                None
            }
        }
    }

    /// Records that copy `name` was read whole and matched the index.
    pub fn mark_checked(&self, name: &str) {
        if let Some(entry) = self.inner.lock().expect("tier").entries.get_mut(name) {
            entry.checked = true;
        }
    }

    /// Removes copy `name` (it differs from the index, or the disk failed reading it).
    pub fn remove(&self, name: &str, why: &str) {
        if self.take_out(name) {
            tracing::warn!(dir = %self.dir.display(), %name, %why, "disk tier: copy removed");
        }
    }

    /// Removes copy `name` as [`Tier::remove`] does, for a caller that says why itself: whether the tier
    /// held it (a caller that finds it gone already has nothing to say).
    pub fn take_out(&self, name: &str) -> bool {
        let mut inner = self.inner.lock().expect("tier");
        let Some(entry) = inner.entries.pop(name) else { return false };
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.let_go(&mut inner, name, entry.size) {
            tracing::debug!(dir = %self.dir.display(), %name, error = %e, "disk tier: cannot remove a copy");
        }
        true
    }

    /// Lets copy `name` (popped from `entries`, `size` bytes of disk) go: its file removed, its keepers
    /// told, and, where a mapping or a file holds it open still, counted in `gone` until closed.
    fn let_go(&self, inner: &mut Inner, name: &str, size: u64) -> io::Result<()> {
        inner.bytes -= size;
        let removed = std::fs::remove_file(self.objects.join(name));
        self.gone(inner, name, size);
        removed
    }

    /// Tells the keepers that copy `name` is let go, and counts it in `gone` while open still.
    fn gone(&self, inner: &mut Inner, name: &str, size: u64) {
        for keeper in self.keepers.lock().expect("tier keepers").iter().filter_map(Weak::upgrade) {
            keeper.let_go(name);
        }
        if let Some(mut opened) = inner.open.remove(name) {
            if alive(&mut opened) {
                inner.gone.push((size, opened));
                inner.gone_bytes += size;
            }
        }
    }

    /// Starts a copy `name` of `size` bytes: room is made for it now (the least recently used copies
    /// evicted; for what it occupies on the disk, [`Tier::on_disk`]), and the file is made under
    /// `staging/`. Refused where it is larger than the tier (`StorageFull`), or does not fit beside the
    /// copies being made now (`WouldBlock`: try later).
    pub fn begin(self: &Arc<Self>, name: &str, size: u64) -> io::Result<Staging> {
        let charge = self.on_disk(size);
        if charge > self.cap {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!("{size} bytes ({charge} on its disk) do not fit in a disk tier of {} bytes", self.cap),
            ));
        }
        {
            let mut inner = self.inner.lock().expect("tier");
            inner.settle();
            // What is being written is not evicted, nor is the disk of copies let go but open freed: with
            // the rest of the room so taken, wait for a later turn (the object is read from the store
            // meanwhile) rather than hold more than the tier, and evict nothing for it.
            let busy = |inner: &Inner| {
                io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!(
                        "{size} bytes do not fit beside the copies being made now ({} bytes) and those evicted \
                         but read still ({} bytes)",
                        inner.reserved, inner.gone_bytes
                    ),
                )
            };
            if inner.reserved + inner.gone_bytes + charge > self.cap {
                return Err(busy(&inner));
            }
            self.make_room(&mut inner, charge);
            if inner.taken() + charge > self.cap {
                return Err(busy(&inner));
            }
            inner.reserved += charge;
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let path = self.staging.join(format!("{name}.{}.{seq}", std::process::id()));
        // Made before the file, so a failure below gives the room back as it drops.
        let mut staging =
            Staging { tier: self.clone(), name: name.to_owned(), path, file: None, charge, committed: false };
        let file =
            std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&staging.path).and_then(|f| {
                allocate(&f, size)?;
                Ok(f)
            });
        match file {
            Ok(file) => {
                staging.file = Some(file);
                Ok(staging)
            }
            Err(e) => Err(self.failed(&staging.path, e)),
        }
    }

    /// Evicts the least recently used copies until `more` bytes fit beside what is held, reserved, and let
    /// go but open (an evicted copy read still is counted on until closed).
    fn make_room(&self, inner: &mut Inner, more: u64) {
        while inner.taken() + more > self.cap {
            // An evicted copy read still frees nothing until closed: once those so let go and the copies
            // being made leave no room even with every copy evicted, evicting more only empties the tier.
            if inner.reserved + inner.gone_bytes + more > self.cap {
                break;
            }
            let Some((name, entry)) = inner.entries.pop_lru() else { break };
            self.counters.evicted.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(dir = %self.dir.display(), %name, bytes = entry.size, "disk tier: evicted");
            if let Err(e) = self.let_go(inner, &name, entry.size) {
                let dir = self.dir.display();
                tracing::warn!(%dir, %name, error = %e, "disk tier: cannot remove an evicted copy");
            }
        }
    }

    /// Counts and logs a write of the tier that failed, and says so with the file's path.
    fn failed(&self, path: &Path, e: io::Error) -> io::Error {
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
        let e = io::Error::new(e.kind(), format!("disk tier: {}: {e}", path.display()));
        if let Some(held_back) = self.lost_log.pass() {
            tracing::warn!(error = %e, held_back, "disk tier: a copy is lost; the object is read from the store");
        }
        e
    }
}

/// A copy being written ([`Tier::begin`]): removed when dropped unless [`Staging::commit`]ted.
pub struct Staging {
    tier: Arc<Tier>,
    name: String,
    path: PathBuf,
    file: Option<File>,
    /// Bytes of disk it occupies, counted from its start ([`Tier::on_disk`]).
    charge: u64,
    committed: bool,
}

impl Staging {
    /// The file to write the copy's bytes into (its length is already the object's).
    pub fn file(&self) -> &File {
        self.file.as_ref().expect("a staging copy has its file")
    }

    /// Makes the checked copy the tier's: renamed into place, the copies of the same object with another
    /// ETag removed. Returns its path.
    pub fn commit(mut self) -> io::Result<PathBuf> {
        let tier = self.tier.clone();
        let at = tier.objects.join(&self.name);
        if let Err(e) = std::fs::rename(&self.path, &at) {
            return Err(tier.failed(&self.path, e));
        }
        self.committed = true;
        let key = self.name.split('-').next().unwrap_or("").to_owned();
        let mut inner = tier.inner.lock().expect("tier");
        inner.reserved -= self.charge;
        let stale: Vec<String> = inner
            .entries
            .iter()
            .filter(|(n, _)| n.split('-').next() == Some(key.as_str()) && **n != self.name)
            .map(|(n, _)| n.clone())
            .collect();
        for name in stale {
            if let Some(entry) = inner.entries.pop(&name) {
                let _ = tier.let_go(&mut inner, &name, entry.size);
            }
        }
        if let Some(old) = inner.entries.put(self.name.clone(), Entry { size: self.charge, checked: true }) {
            // Replaced by the rename: the old file is gone from its name, open still where it was opened.
            inner.bytes -= old.size;
            tier.gone(&mut inner, &self.name, old.size);
        }
        inner.bytes += self.charge;
        tier.counters.staged.fetch_add(1, Ordering::Relaxed);
        Ok(at)
    }

    /// The copy opened again for reading and writing past the page cache (`O_DIRECT`); an error where the
    /// filesystem refuses it (`EINVAL`).
    pub fn open_direct(&self) -> io::Result<File> {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(&self.path)
    }

    /// Counts and logs a write into the copy that failed ([`Tier`]'s note): the copy is dropped.
    pub fn failed(&self, e: io::Error) -> io::Error {
        self.tier.failed(&self.path, e)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            self.file = None;
            let _ = std::fs::remove_file(&self.path);
            self.tier.inner.lock().expect("tier").reserved -= self.charge;
        }
    }
}

/// Gives `file` its `size` bytes on the disk now (`posix_fallocate`), so that a copy written through a
/// mapping never finds the disk full halfway (a store into a mapped page the filesystem cannot back is a
/// SIGBUS, not an error): a full disk is an error here, before the first byte.
pub fn allocate(file: &File, size: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    file.set_len(size)?;
    if size == 0 {
        return Ok(());
    }
    // SAFETY: posix_fallocate reads no memory of ours; the descriptor is open for the call (borrowed).
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size as libc::off_t) };
    match rc {
        0 => Ok(()),
        rc => Err(io::Error::from_raw_os_error(rc)),
    }
}

/// Whether `name` is a copy's name ([`Tier::name`]).
fn is_name(name: &str) -> bool {
    let hexes = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    matches!(name.split_once('-'), Some((k, e)) if hexes(k, 32) && hexes(e, 16))
}

/// Appends `bytes` in lower-case hex (a name is made for every read of a copy: no `format!` per byte).
fn hex_into(out: &mut String, bytes: &[u8]) {
    out.extend(bytes.iter().flat_map(|&b| batchfs::index::hex_pair(b)).map(char::from));
}

/// Whether a tier of `cap` bytes is larger than what its filesystem can hold of it: `free` bytes free
/// (to the server) and the `held` bytes of its copies.
fn past_the_disk(cap: u64, free: u64, held: u64) -> bool {
    cap > free.saturating_add(held)
}

/// Bytes free (for an unprivileged user) on the filesystem of `dir`, and its block: the unit a file
/// occupies on it (`f_frsize`; 4 KiB where it says 0).
fn room(dir: &Path) -> io::Result<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: statvfs writes only the struct passed, which lives for the call; `path` is a valid C string.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let block = match stat.f_frsize as u64 {
        0 => 4096,
        n => n,
    };
    Ok((stat.f_bavail as u64 * stat.f_frsize as u64, block))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::AutoSize;
    use std::os::unix::fs::FileExt;

    fn stage(tier: &Arc<Tier>, name: &str, bytes: &[u8]) -> PathBuf {
        let copy = tier.begin(name, bytes.len() as u64).unwrap();
        copy.file().write_all_at(bytes, 0).unwrap();
        copy.commit().unwrap()
    }

    /// The block of `dir`'s filesystem, what a copy's size is rounded up to: the tests' unit of size.
    fn block(dir: &Path) -> u64 {
        room(dir).unwrap().1
    }

    /// Bytes of disk the files under `dir` take (`st_blocks`, 512 bytes each).
    fn disk_used(dir: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().metadata().unwrap().blocks() * 512).sum()
    }

    /// Copies count the blocks they take on the disk, not their sizes, so `disk_cache_size` bounds the
    /// disk used: counted by their sizes, 1,398 copies of a few bytes under a cap of 2 MiB took 5.9 MB.
    /// Found again at a restart, they are counted the same.
    #[test]
    fn copies_count_the_disk_they_occupy_and_are_found_again_so() {
        let dir = tempfile::tempdir().unwrap();
        let b = block(dir.path());
        let tier = Arc::new(Tier::open(dir.path(), AutoSize::Bytes(8 * b)).unwrap());
        for k in 0..20 {
            stage(&tier, &Tier::name(&format!("s3 b/tiny-{k}"), "\"e\""), &[7; 100]);
        }
        assert_eq!((tier.copies(), tier.bytes()), (8, 8 * b));
        assert!(disk_used(&dir.path().join("objects")) <= tier.cap(), "the cap bounds the disk used");
        assert_eq!((tier.on_disk(0), tier.on_disk(1), tier.on_disk(b), tier.on_disk(b + 1)), (0, b, b, 2 * b));
        drop(tier);
        let again = Tier::open(dir.path(), AutoSize::Bytes(8 * b)).unwrap();
        assert_eq!((again.copies(), again.bytes()), (8, 8 * b));
        drop(again);
        let smaller = Arc::new(Tier::open(dir.path(), AutoSize::Bytes(4 * b + 100)).unwrap());
        assert_eq!((smaller.copies(), smaller.bytes()), (4, 4 * b));
        // Larger than the tier once rounded up: refused, as one larger than it by its size.
        let big = Tier::name("s3 b/big", "\"e\"");
        assert_eq!(smaller.begin(&big, 4 * b + 1).err().unwrap().kind(), io::ErrorKind::StorageFull);
        assert!(smaller.begin(&big, 4 * b).is_ok());
    }

    /// A restarted server finds the copies an older one made by their names: the name of a copy never
    /// changes (here, as `md5sum` gives it: the key's MD5, a dash, the first 16 digits of the ETag's).
    #[test]
    fn a_copy_is_named_as_before() {
        let name = Tier::name(
            "http://127.0.0.1:8333 bucket/train/shard-0001.tfrecord",
            "\"9b2cf535f27731c974343645a3985328\"",
        );
        assert_eq!(name, "ba4a81e110f11c8b821855877c2cd742-b41c2386e2d5d2f0");
        assert!(is_name(&name));
    }

    #[test]
    fn copies_being_made_are_never_evicted_and_the_tier_never_holds_more_than_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let b = block(dir.path());
        let tier = Arc::new(Tier::open(dir.path(), AutoSize::Bytes(10 * b)).unwrap());
        stage(&tier, &Tier::name("s3 b/k1", "\"e\""), &vec![1; 3 * b as usize]);
        let making = tier.begin(&Tier::name("s3 b/k2", "\"e\""), 7 * b).unwrap();
        // One that does not fit beside the copy being made waits its turn, and evicts nothing for it.
        let next = tier.begin(&Tier::name("s3 b/k3", "\"e\""), 4 * b);
        assert_eq!(next.err().unwrap().kind(), io::ErrorKind::WouldBlock);
        assert_eq!((tier.copies(), tier.bytes()), (1, 3 * b));
        drop(making);
        assert!(tier.begin(&Tier::name("s3 b/k3", "\"e\""), 4 * b).is_ok());
    }

    /// Something keeping one copy open between reads, as a dataset's mapped copies do.
    struct KeepsOne(Mutex<Option<Arc<File>>>);

    impl Keeper for KeepsOne {
        fn let_go(&self, _name: &str) {
            self.0.lock().unwrap().take();
        }
    }

    /// A copy evicted while a body reads it stays on the disk until the body is done (the kernel frees an
    /// unlinked file at its last close): the tier counts it until then, and a copy that does not fit beside
    /// it waits its turn (before, evicted copies held open took the disk to 2.4 times the cap). What keeps
    /// copies open between reads is told of the eviction at once, so only the body holds it.
    #[test]
    fn a_copy_evicted_while_open_is_counted_until_closed_and_its_keepers_let_go_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let u = block(dir.path());
        let tier = Arc::new(Tier::open(dir.path(), AutoSize::Bytes(10 * u)).unwrap());
        let names: Vec<String> = (0..5).map(|k| Tier::name(&format!("s3 b/k{k}"), "\"e\"")).collect();
        let a = stage(&tier, &names[0], &vec![1; 4 * u as usize]);
        stage(&tier, &names[1], &vec![2; 4 * u as usize]);
        let body = Arc::new(File::open(&a).unwrap());
        assert!(tier.opened(&names[0], Arc::downgrade(&body) as Opened));
        let keeper = Arc::new(KeepsOne(Mutex::new(Some(body.clone()))));
        tier.keep_with(Arc::downgrade(&keeper) as Weak<dyn Keeper>);
        // `a`, the least recently used, is evicted for `c`: unlinked, let go by its keeper, open by the body,
        // so its disk is not free: `b` goes too.
        stage(&tier, &names[2], &vec![3; 4 * u as usize]);
        assert!(!tier.contains(&names[0]) && !a.exists() && !tier.contains(&names[1]));
        assert!(keeper.0.lock().unwrap().is_none(), "the keeper let go at once");
        assert_eq!((tier.bytes(), tier.gone_bytes()), (4 * u, 4 * u));
        // `d` fits beside `c` and the open `a`; then `e` does not fit beside `d` and the open `a`, and waits,
        // evicting nothing.
        let d = tier.begin(&names[3], 2 * u).unwrap();
        let e = tier.begin(&names[4], 5 * u);
        assert_eq!(e.err().unwrap().kind(), io::ErrorKind::WouldBlock);
        assert!(tier.contains(&names[2]));
        assert!(disk_used(&dir.path().join("objects")) + disk_used(&dir.path().join("staging")) + 4 * u <= tier.cap());
        // The body done, the disk is free, and `e` fits.
        drop(body);
        assert_eq!(tier.gone_bytes(), 0);
        assert!(tier.begin(&names[4], 5 * u).is_ok());
        drop(d);
    }

    /// A `disk_cache_size` past the disk is said at start (it was not: the disk filled, and copies failed
    /// one after another); `auto` never is.
    #[test]
    fn a_tier_larger_than_its_disk_is_said() {
        assert!(past_the_disk(100 << 30, 10 << 30, 5 << 30));
        assert!(!past_the_disk(15 << 30, 10 << 30, 5 << 30) && !past_the_disk(u64::MAX, u64::MAX, 1));
        let dir = tempfile::tempdir().unwrap();
        let (free, _) = room(dir.path()).unwrap();
        assert!(!past_the_disk((free / 10) * 9, free, 0), "what auto takes");
    }

    /// Room that cannot be made (the copies evicted are read still, their disk not free) empties the tier no
    /// further than it must find so: a copy no one reads stays (every copy was evicted, and the new one
    /// refused anyway).
    #[test]
    fn room_that_cannot_be_made_for_copies_read_still_evicts_no_copy_more() {
        let dir = tempfile::tempdir().unwrap();
        let u = block(dir.path());
        let tier = Arc::new(Tier::open(dir.path(), AutoSize::Bytes(10 * u)).unwrap());
        let names: Vec<String> = (0..4).map(|k| Tier::name(&format!("s3 b/k{k}"), "\"e\"")).collect();
        let a = stage(&tier, &names[0], &vec![1; 4 * u as usize]);
        let b = stage(&tier, &names[1], &vec![2; 3 * u as usize]);
        stage(&tier, &names[2], &vec![3; 3 * u as usize]);
        let bodies = [Arc::new(File::open(&a).unwrap()), Arc::new(File::open(&b).unwrap())];
        for (name, body) in names.iter().zip(&bodies) {
            assert!(tier.opened(name, Arc::downgrade(body) as Opened));
        }
        let d = tier.begin(&names[3], 5 * u);
        assert_eq!(d.err().unwrap().kind(), io::ErrorKind::WouldBlock);
        assert!(tier.contains(&names[2]), "the copy no one reads kept");
        drop(bodies);
        assert!(tier.begin(&names[3], 5 * u).is_ok(), "room once the bodies are done");
    }

    /// A directory another server's tier holds is refused, saying so (before, the second server's start
    /// removed the first's copies being made); a size of 0 is refused as such, not as a full disk.
    #[test]
    fn a_tier_another_process_holds_or_of_no_size_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(Tier::open(dir.path(), AutoSize::Bytes(100)).unwrap());
        // Another process holding the lock as a server's tier does (a POSIX record lock of the whole file).
        let script = "import fcntl, sys, time\nf = open(sys.argv[1], 'a')\nfcntl.lockf(f, fcntl.LOCK_EX)\n\
                      print('locked', flush=True)\ntime.sleep(60)";
        let mut other = std::process::Command::new("python3")
            .args(["-c", script])
            .arg(dir.path().join("lock"))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut said = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(other.stdout.take().unwrap()), &mut said).unwrap();
        assert_eq!(said.trim(), "locked");
        let e = Tier::open(dir.path(), AutoSize::Bytes(100)).err().map(|e| e.to_string());
        let _ = other.kill();
        let _ = other.wait();
        assert!(e.as_ref().is_some_and(|e| e.contains("another server uses it")), "{e:?}");
        let e = Tier::open(dir.path(), AutoSize::Bytes(0)).err().map(|e| e.to_string());
        assert!(e.as_ref().is_some_and(|e| e.contains("disk_cache_size is 0")), "{e:?}");
        assert!(Tier::open(dir.path(), AutoSize::Bytes(100)).is_ok(), "free again once that process ended");
    }

    #[test]
    fn copies_are_found_again_evicted_least_recently_used_and_never_half_written() {
        let dir = tempfile::tempdir().unwrap();
        // Sizes in blocks of the disk (a tenth of the tier each), as the tier counts them.
        let u = block(dir.path());
        let fill = |byte: u8, blocks: u64| vec![byte; (blocks * u) as usize];
        let tier = Arc::new(Tier::open(dir.path(), AutoSize::Bytes(10 * u)).unwrap());
        let (a, b, c) =
            (Tier::name("s3 b/k1", "\"e1\""), Tier::name("s3 b/k2", "\"e\""), Tier::name("s3 b/k3", "\"e\""));
        assert_ne!(a, Tier::name("s3 b/k1", "\"e2\""), "a new ETag is another copy");
        assert!(is_name(&a), "{a}");
        let path = stage(&tier, &a, &fill(1, 4));
        assert_eq!(std::fs::read(&path).unwrap(), fill(1, 4));
        stage(&tier, &b, &fill(2, 4));
        assert_eq!((tier.bytes(), tier.copies()), (8 * u, 2));
        // `a` used last: `b` goes to make room for `c`.
        assert!(tier.get(&a).is_some());
        stage(&tier, &c, &fill(3, 4));
        assert!(tier.contains(&a) && !tier.contains(&b) && tier.contains(&c));
        assert_eq!(tier.counters.evicted.load(Ordering::Relaxed), 1);
        // A read of a mapping counts as a use (`used`), a look (`contains`) does not: `c` goes for `b`.
        assert!(tier.used(&a) && tier.contains(&c));
        stage(&tier, &b, &fill(2, 4));
        assert!(tier.contains(&a) && tier.contains(&b) && !tier.contains(&c));
        stage(&tier, &c, &fill(3, 4));
        assert!(!tier.contains(&a) && tier.contains(&b) && tier.contains(&c));
        stage(&tier, &a, &fill(1, 4));
        assert!(tier.contains(&a) && !tier.contains(&b) && tier.contains(&c));
        assert_eq!(tier.counters.evicted.load(Ordering::Relaxed), 4);
        // A copy dropped unfinished leaves nothing, and gives its room back.
        let unfinished = tier.begin(&b, 2 * u).unwrap();
        assert_eq!(std::fs::read_dir(dir.path().join("staging")).unwrap().count(), 1);
        drop(unfinished);
        assert_eq!(std::fs::read_dir(dir.path().join("staging")).unwrap().count(), 0);
        // Too large for the tier: refused, nothing evicted.
        assert_eq!(tier.begin(&b, 10 * u + 1).err().unwrap().kind(), io::ErrorKind::StorageFull);
        assert_eq!(tier.copies(), 2);
        // A new ETag of `a` replaces the old copy.
        let a2 = Tier::name("s3 b/k1", "\"e2\"");
        stage(&tier, &a2, &fill(4, 1));
        assert!(!tier.contains(&a) && tier.contains(&a2) && !dir.path().join("objects").join(&a).exists());
        // A server killed while staging: its file under staging/ is removed at the next start, and the
        // copies are found again, not yet checked in the new process.
        let killed = tier.begin(&b, u / 2).unwrap();
        std::mem::forget(killed);
        // And indexing's directory of links to a copy, as a server killed while indexing leaves it.
        std::fs::create_dir(dir.path().join("staging/batchfs-stage-x")).unwrap();
        std::fs::write(dir.path().join("staging/batchfs-stage-x/shard"), b"linked").unwrap();
        drop(tier);
        let again = Tier::open(dir.path(), AutoSize::Bytes(10 * u)).unwrap();
        assert_eq!(std::fs::read_dir(dir.path().join("staging")).unwrap().count(), 0);
        assert_eq!((again.copies(), again.bytes()), (2, 5 * u));
        let (path, checked) = again.get(&c).unwrap();
        assert!(!checked && std::fs::read(path).unwrap() == fill(3, 4));
        again.mark_checked(&c);
        assert!(again.get(&c).unwrap().1);
        again.remove(&c, "differs");
        assert!(!again.contains(&c) && again.bytes() == u);
        // Smaller now: what does not fit is evicted at start.
        drop(again);
        assert_eq!(Tier::open(dir.path(), AutoSize::Bytes(u / 2)).unwrap().copies(), 0);
    }

    /// A copy found at start is checked by its first reader while the others wait for the verdict, never
    /// checking it again (before, every body reaching it before the first was done read it whole again);
    /// a copy whose check fails is removed, and a reader after finds no copy.
    #[test]
    fn a_copy_found_at_start_is_checked_once_while_its_other_readers_wait() {
        let dir = tempfile::tempdir().unwrap();
        let u = block(dir.path());
        let (a, b) = (Tier::name("s3 b/k1", "\"e\""), Tier::name("s3 b/k2", "\"e\""));
        let tier = Arc::new(Tier::open(dir.path(), AutoSize::Bytes(10 * u)).unwrap());
        stage(&tier, &a, &[1; 100]);
        stage(&tier, &b, &[2; 100]);
        assert!(!tier.is_unchecked(&a), "a copy made here is checked");
        drop(tier);
        let tier = Arc::new(Tier::open(dir.path(), AutoSize::Bytes(10 * u)).unwrap());
        assert!(tier.is_unchecked(&a) && tier.is_unchecked(&b));
        let (started, go) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
        let first = std::thread::spawn({
            let (tier, a) = (tier.clone(), a.clone());
            move || {
                tier.checked_copy(&a, |_| {
                    started.0.send(()).unwrap();
                    go.1.recv().unwrap();
                    Ok(())
                })
            }
        });
        started.1.recv().unwrap();
        let second = std::thread::spawn({
            let (tier, a) = (tier.clone(), a.clone());
            move || tier.checked_copy(&a, |_| panic!("checked again"))
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!second.is_finished() && tier.is_unchecked(&a), "the second reader waits for the verdict");
        go.0.send(()).unwrap();
        assert_eq!(first.join().unwrap(), Some(dir.path().join("objects").join(&a)));
        assert_eq!(second.join().unwrap(), Some(dir.path().join("objects").join(&a)));
        assert!(!tier.is_unchecked(&a) && tier.checked_by.lock().unwrap().len() == 1);
        // A check that fails removes the copy; the next reader finds none (and checks nothing).
        let differs = || Err(io::Error::new(io::ErrorKind::InvalidData, "chunk 0 differs from the index"));
        assert_eq!(tier.checked_copy(&b, |_| differs()), None);
        assert!(!tier.contains(&b) && !dir.path().join("objects").join(&b).exists());
        assert_eq!(tier.checked_copy(&b, |_| panic!("checked again")), None);
        assert_eq!(tier.counters.failures.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_tier_that_cannot_be_written_is_refused_with_its_reason() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let e = Tier::open(&file.join("tier"), AutoSize::Bytes(100)).err().unwrap();
        assert!(matches!(e, TierError::Create { .. }), "{e}");
        assert!(e.to_string().contains("disk_cache"), "{e}");
        let auto = Tier::open(&dir.path().join("auto"), AutoSize::Auto).unwrap();
        assert!(auto.cap() > 0);
    }
}
