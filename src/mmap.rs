//! The one place that maps files and opens LMDB environments: every `unsafe` block of the core lives
//! here, each with its `SAFETY` argument.
//!
//! Invariant relied on by readers of the bytes: **dataset files are immutable while indexed or served.**
//! The index records each shard's size and modification time and is rebuilt when they change. A file
//! changed anyway under a mapping (a conversion script rewriting a shard in place) shows its new bytes,
//! which the clients' checksums refuse; one truncated under it would raise SIGBUS at the first touch of
//! a page past its new end, and kill the process. With [`guard_truncation`] (the server calls it at
//! start) such a touch reads a page of zeros instead, the mapping remembers it ([`MappedFile::was_cut`]),
//! and the server refuses what it would have served from it.

use memmap2::{Advice, Mmap};
use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

/// A read-only mapping of a whole file, or a file's bytes held in anonymous memory
/// ([`MappedFile::in_memory`]). Empty files map to an empty slice.
#[derive(Debug)]
pub struct MappedFile {
    map: Option<Mmap>,
    /// The file's length: the mapping's, or less for memory rounded up to whole pages.
    len: usize,
    /// The slot of a file mapping in the truncation guard's registry.
    guarded: Option<usize>,
    /// A mapping of a file (not memory the process filled).
    from_file: bool,
    /// Registered in [`source_of`]'s table (a mapping made by [`MappedFile::open_sourced`]).
    sourced: bool,
}

impl MappedFile {
    /// Maps `path` read-only.
    pub fn open(path: &Path) -> io::Result<Self> {
        Self::open_file(&File::open(path)?)
    }

    /// Maps `file` read-only, like [`MappedFile::open_file`], and keeps it open with the mapping, so that
    /// [`source_of`] finds it from the mapping's bytes: a sender can then have the kernel send them from
    /// the file's pages (`sendfile(2)`) instead of copying them out of the mapping. One descriptor per
    /// mapping, for as long as it lives. (A file, not a path: the server opens a dataset's files beneath
    /// its directory.)
    pub fn open_sourced(file: File) -> io::Result<Self> {
        let mut mapped = Self::open_file(&file)?;
        if let Some(map) = &mapped.map {
            sources::register(map.as_ptr() as usize, mapped.len, Arc::new(file));
            mapped.sourced = true;
        }
        Ok(mapped)
    }

    /// Maps an open file read-only.
    pub fn open_file(file: &File) -> io::Result<Self> {
        if file.metadata()?.len() == 0 {
            return Ok(MappedFile { map: None, len: 0, guarded: None, from_file: true, sourced: false });
        }
        // SAFETY: the mapping is read-only and private to this process; batchfs requires dataset files
        // to stay unmodified while mapped (module invariant), so the slice's contents do not change
        // underneath safe code.
        let map = unsafe { Mmap::map(file)? };
        let len = map.len();
        let guarded = guard::register(map.as_ptr() as usize, len);
        Ok(MappedFile { map: Some(map), len, guarded, from_file: true, sourced: false })
    }

    /// `len` bytes of anonymous memory the process owns, filled once by `fill` and read-only after: a
    /// file held in memory, read like a mapping but never evicted (and never read from storage again).
    /// `fill` gets `len` rounded up to whole pages, so aligned direct reads can fill the last block
    /// whole; it must fill the first `len`.
    pub fn in_memory(len: usize, fill: impl FnOnce(&mut [u8]) -> io::Result<()>) -> io::Result<Self> {
        if len == 0 {
            return Ok(MappedFile { map: None, len: 0, guarded: None, from_file: false, sourced: false });
        }
        let mut memory = memmap2::MmapMut::map_anon(len.div_ceil(page_size()) * page_size())?;
        fill(&mut memory)?;
        Ok(MappedFile { map: Some(memory.make_read_only()?), len, guarded: None, from_file: false, sourced: false })
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().map_or(&[], |map| &map[..self.len])
    }

    /// Length of the file.
    pub fn len(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether this maps a file (not memory filled by [`MappedFile::in_memory`]).
    pub fn is_file(&self) -> bool {
        self.from_file
    }

    /// Whether a page of the mapping was touched past the file's end (the file was truncated under it)
    /// and reads zeros since ([`guard_truncation`]): its bytes are not the file's.
    pub fn was_cut(&self) -> bool {
        self.guarded.is_some_and(guard::was_cut)
    }

    /// Advises the kernel about the access pattern of the whole map.
    pub fn advise(&self, advice: Advice) {
        if let Some(map) = &self.map {
            let _ = map.advise(advice);
        }
    }

    /// Touches every page of `[offset, offset + len)` so it is resident afterwards (blocks on storage:
    /// call where blocking is allowed).
    pub fn fault_in(&self, offset: u64, len: u64) {
        let bytes = self.bytes();
        let end = offset.saturating_add(len).min(bytes.len() as u64);
        let page = page_size() as u64;
        let mut sum = 0u8;
        // The range's first byte, then the first byte of every later page it reaches: stepping by a page
        // from an unaligned start would miss the last one.
        let mut at = offset;
        while at < end {
            sum = sum.wrapping_add(bytes[at as usize]);
            at = (at / page + 1) * page;
        }
        std::hint::black_box(sum);
    }

    /// Asks the kernel to start reading `[offset, offset + len)` into the page cache (non-blocking).
    pub fn will_need(&self, offset: u64, len: u64) {
        if let Some(map) = &self.map {
            let (offset, len) = page_align(offset, len, self.len);
            let _ = map.advise_range(Advice::WillNeed, offset, len);
        }
    }

    /// Whether every page of `[offset, offset + len)` is resident in memory, so touching it cannot block
    /// on storage. Errors count as "not resident".
    pub fn is_resident(&self, offset: u64, len: u64) -> bool {
        let Some(map) = &self.map else { return true };
        if len == 0 {
            return true;
        }
        let (start, len) = page_align(offset, len, self.len);
        let page = page_size();
        let pages = len.div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: `start` is page-aligned and `[start, start + len)` lies within the live mapping (clamped
        // by `page_align`); `vec` has one byte per page of that range, as mincore(2) requires.
        let rc = unsafe { libc::mincore(map.as_ptr().add(start) as *mut libc::c_void, len, vec.as_mut_ptr()) };
        rc == 0 && vec.iter().all(|b| b & 1 == 1)
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // Out of the table before the mapping goes (the fields drop after this), so that an address in
        // the table is always one of a live mapping of that file.
        if let (true, Some(map)) = (self.sourced, &self.map) {
            sources::unregister(map.as_ptr() as usize);
        }
        // Out of the registry before the mapping goes (the fields drop after this).
        if let Some(slot) = self.guarded {
            guard::unregister(slot);
        }
    }
}

/// The file `bytes` were mapped from and their offset in it, if they lie within one mapping made by
/// [`MappedFile::open_sourced`] that is still alive (as it is while `bytes` borrows it). The file is the one the
/// mapping was made of, shared: its pages are the mapping's.
pub fn source_of(bytes: &[u8]) -> Option<(Arc<File>, u64)> {
    sources::find(bytes.as_ptr() as usize, bytes.len())
}

/// The files of live mappings by address, for [`source_of`].
mod sources {
    use super::*;

    struct Source {
        len: usize,
        file: Arc<File>,
    }

    static TABLE: RwLock<BTreeMap<usize, Source>> = RwLock::new(BTreeMap::new());

    pub(super) fn register(start: usize, len: usize, file: Arc<File>) {
        TABLE.write().unwrap_or_else(|e| e.into_inner()).insert(start, Source { len, file });
    }

    pub(super) fn unregister(start: usize) {
        TABLE.write().unwrap_or_else(|e| e.into_inner()).remove(&start);
    }

    pub(super) fn find(at: usize, len: usize) -> Option<(Arc<File>, u64)> {
        let table = TABLE.read().unwrap_or_else(|e| e.into_inner());
        let (&start, source) = table.range(..=at).next_back()?;
        let end = at.checked_add(len)?;
        (end <= start + source.len).then(|| (source.file.clone(), (at - start) as u64))
    }
}

/// Makes a mapped file truncated under this process read zeros where its pages are gone, instead of
/// killing the process with SIGBUS: a SIGBUS at an address of a file mapping (made before this call or
/// after) replaces that page with a page of zeros and marks the mapping ([`MappedFile::was_cut`]); any
/// other SIGBUS goes where it went before. Once per process; later calls do nothing.
pub fn guard_truncation() -> io::Result<()> {
    guard::install()
}

/// Whether any mapping of this process has been cut ([`MappedFile::was_cut`]) since it started: one
/// atomic load, for a caller to look at its mappings only once one has.
pub fn any_cut() -> bool {
    guard::ANY_CUT.load(Ordering::Acquire)
}

/// The registry of file mappings and the SIGBUS handler that repairs them. The handler only reads
/// atomics, calls `mmap` (async-signal-safe) and chains to the handler it replaced.
mod guard {
    use super::*;

    /// Mappings guarded at once at most (more, and the rest are not: the kernel allows 65,530 per process).
    const SLOTS: usize = 1 << 16;

    struct Slot {
        start: AtomicUsize,
        len: AtomicUsize,
        cut: AtomicBool,
    }

    #[allow(clippy::declare_interior_mutable_const)]
    const EMPTY: Slot = Slot { start: AtomicUsize::new(0), len: AtomicUsize::new(0), cut: AtomicBool::new(false) };
    static REGISTRY: [Slot; SLOTS] = [EMPTY; SLOTS];
    /// Slots below this may be in use (the handler looks at no more).
    static USED: AtomicUsize = AtomicUsize::new(0);
    /// Where the next registration starts looking for a free slot.
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    static PAGE: AtomicUsize = AtomicUsize::new(4096);
    /// A mapping was cut (any, ever).
    pub(super) static ANY_CUT: AtomicBool = AtomicBool::new(false);
    static INSTALLED: OnceLock<Result<Box<libc::sigaction>, i32>> = OnceLock::new();

    pub(super) fn install() -> io::Result<()> {
        let installed = INSTALLED.get_or_init(|| {
            PAGE.store(page_size(), Ordering::Relaxed);
            // SAFETY: `action` is zeroed and then filled as sigaction(2) requires (a handler taking
            // siginfo, every signal left unblocked); `previous` receives the handler replaced, kept for
            // the process's life so the handler can chain to it.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_sigbus as *const () as usize;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut action.sa_mask);
                let mut previous: Box<libc::sigaction> = Box::new(std::mem::zeroed());
                if libc::sigaction(libc::SIGBUS, &action, &mut *previous) != 0 {
                    return Err(io::Error::last_os_error().raw_os_error().unwrap_or(0));
                }
                Ok(previous)
            }
        });
        installed.as_ref().map(|_| ()).map_err(|&e| io::Error::from_raw_os_error(e))
    }

    /// Registers the file mapping `[start, start + len)`, whether the guard is on yet or not (a server
    /// maps its shards before it starts serving); its slot, if one was free.
    pub(super) fn register(start: usize, len: usize) -> Option<usize> {
        let from = NEXT.fetch_add(1, Ordering::Relaxed);
        for k in 0..SLOTS {
            let i = (from + k) % SLOTS;
            let slot = &REGISTRY[i];
            if slot.start.compare_exchange(0, start, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                slot.cut.store(false, Ordering::Relaxed);
                slot.len.store(len, Ordering::Release);
                USED.fetch_max(i + 1, Ordering::AcqRel);
                return Some(i);
            }
        }
        None
    }

    pub(super) fn unregister(slot: usize) {
        REGISTRY[slot].len.store(0, Ordering::Release);
        REGISTRY[slot].start.store(0, Ordering::Release);
    }

    pub(super) fn was_cut(slot: usize) -> bool {
        REGISTRY[slot].cut.load(Ordering::Acquire)
    }

    extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
        // SAFETY: the kernel passes a valid siginfo to a SA_SIGINFO handler; for SIGBUS `si_addr` is the
        // faulting address.
        let addr = unsafe { (*info).si_addr() } as usize;
        let page = PAGE.load(Ordering::Relaxed);
        for slot in &REGISTRY[..USED.load(Ordering::Acquire).min(SLOTS)] {
            let start = slot.start.load(Ordering::Acquire);
            let len = slot.len.load(Ordering::Acquire);
            if start == 0 || addr < start || addr >= start + len {
                continue;
            }
            // SAFETY: the page lies within a live read-only file mapping of this process (registered
            // until just before it is unmapped): replacing it with a private page of zeros at the same
            // address changes what reads of it see (zeros, where the file is gone), not what memory is
            // valid; the faulting access is retried on the new page when the handler returns.
            let replaced = unsafe {
                libc::mmap(
                    (addr & !(page - 1)) as *mut libc::c_void,
                    page,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if replaced != libc::MAP_FAILED {
                slot.cut.store(true, Ordering::Release);
                ANY_CUT.store(true, Ordering::Release);
                return;
            }
        }
        // Not a page of a guarded mapping: whatever the replaced handler would have done.
        let Some(Ok(previous)) = INSTALLED.get() else { return };
        let handler = previous.sa_sigaction;
        if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
            // SAFETY: restoring the default action is async-signal-safe; the faulting access then runs
            // again and the kernel applies it (the process dies, with a core where enabled).
            unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        } else if previous.sa_flags & libc::SA_SIGINFO != 0 {
            // SAFETY: the replaced handler was installed with SA_SIGINFO, so it has this signature.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(handler) };
            f(signal, info, context);
        } else {
            // SAFETY: without SA_SIGINFO the replaced handler takes the signal number only.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
            f(signal);
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

/// Rounds `[offset, offset+len)` out to page boundaries, clamped to `map_len`.
fn page_align(offset: u64, len: u64, map_len: usize) -> (usize, usize) {
    let page = page_size() as u64;
    let start = (offset / page * page).min(map_len as u64);
    let end = offset.saturating_add(len).min(map_len as u64);
    (start as usize, end.saturating_sub(start) as usize)
}

/// A read-only LMDB environment opened without a lock file.
pub struct LmdbEnv {
    env: heed::Env,
}

impl LmdbEnv {
    /// Opens the environment in directory `dir` strictly read-only: `MDB_RDONLY | MDB_NOLOCK`, so no
    /// `lock.mdb` is created or written and a read-only filesystem works.
    pub fn open_read_only(dir: &Path) -> heed::Result<Self> {
        let mut options = heed::EnvOpenOptions::new();
        options.max_dbs(0);
        // SAFETY: (1) the flags only restrict what LMDB does: read-only, no lock table; (2) heed requires
        // that the environment is not modified by others while open without locks, which is batchfs's
        // module invariant (immutable datasets); (3) no other handle to this path is open in this process
        // (the indexer opens, walks and closes it).
        let env = unsafe {
            options.flags(heed::EnvFlags::READ_ONLY | heed::EnvFlags::NO_LOCK);
            options.open(dir)?
        };
        Ok(LmdbEnv { env })
    }

    /// Creates (or opens for writing) an environment in `dir` with room for `map_size` bytes and
    /// `max_dbs` named databases besides the main one; used by the sample-data generator and tests.
    pub fn create(dir: &Path, map_size: usize, max_dbs: u32) -> heed::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut options = heed::EnvOpenOptions::new();
        options.map_size(map_size).max_dbs(max_dbs);
        // SAFETY: heed requires that no other handle to this environment is open in this process and
        // that no one else modifies it unsafely; the generator creates a fresh directory it alone writes.
        let env = unsafe { options.open(dir)? };
        Ok(LmdbEnv { env })
    }

    /// The environment.
    pub fn env(&self) -> &heed::Env {
        &self.env
    }

    /// Closes the environment and waits until LMDB released it, so the path can be opened again.
    pub fn close(self) {
        self.env.prepare_for_closing().wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapping made by `open_sourced` is found from any slice within it, with the slice's offset and the file
    /// it was mapped from; a slice reaching past it, memory of another kind, and the mapping once dropped
    /// are not.
    #[test]
    fn slices_of_opened_mappings_find_their_file() {
        use std::io::{Read, Seek, SeekFrom};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        assert!(source_of(MappedFile::open(&path).unwrap().bytes()).is_none(), "not kept without asking");
        let mapped = MappedFile::open_sourced(File::open(&path).unwrap()).unwrap();
        let bytes = mapped.bytes();
        let (file, offset) = source_of(&bytes[12_345..60_000]).unwrap();
        assert_eq!(offset, 12_345);
        let mut read = vec![0; 10];
        let mut file = &*file;
        file.seek(SeekFrom::Start(offset)).unwrap();
        file.read_exact(&mut read).unwrap();
        assert_eq!(read, data[12_345..12_355]);
        assert_eq!(source_of(bytes).map(|(_, at)| at), Some(0));
        // SAFETY: the slice, one byte past the file's end, lies within the mapping's last page; it is never read.
        let past = unsafe { std::slice::from_raw_parts(bytes.as_ptr().add(50_000), 50_001) };
        assert!(source_of(past).is_none());
        assert!(source_of(&data).is_none());
        let held = MappedFile::in_memory(data.len(), |m| {
            let _: () = m[..data.len()].copy_from_slice(&data);
            Ok(())
        })
        .unwrap();
        assert!(source_of(held.bytes()).is_none());
        let at = bytes.as_ptr() as usize;
        drop(mapped);
        assert!(sources::find(at, 10).is_none());
    }
    use std::io::Write;

    /// Every page a range touches is faulted in, the last one of a range that starts mid-page included
    /// (a range from byte 4000 to 4200 lies on two pages; stepping by pages from 4000 touched one). The
    /// file's pages are dropped from the page cache first and the mapping read at random (no readahead),
    /// so only what `fault_in` touches is resident.
    #[test]
    fn fault_in_touches_every_page_of_an_unaligned_range() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(&vec![5u8; 8 * 4096]).unwrap();
        file.as_file().sync_all().unwrap();
        let page = page_size() as u64;
        for (offset, len) in [(4000, 200), (page - 1, 2), (3 * page + 7, 2 * page)] {
            // SAFETY: fadvise has no memory-safety preconditions; the fd is open.
            let rc = unsafe {
                use std::os::fd::AsRawFd;
                libc::posix_fadvise(file.as_file().as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED)
            };
            assert_eq!(rc, 0);
            let map = MappedFile::open(file.path()).unwrap();
            map.advise(Advice::Random);
            if map.is_resident(0, 8 * page) {
                eprintln!("the page cache kept the file (another reader?): nothing to check");
                return;
            }
            map.fault_in(offset, len);
            assert!(map.is_resident(offset, len), "[{offset}, {}) faulted in", offset + len);
        }
    }

    /// A file truncated under its mapping: with the guard on, a touch past the new end reads zeros (the
    /// process lives) and the mapping says it was cut; the bytes before the end are the file's.
    #[test]
    fn a_file_truncated_under_a_guarded_mapping_reads_zeros_and_says_so() {
        guard_truncation().unwrap();
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(&vec![5u8; 4 * 4096]).unwrap();
        let map = MappedFile::open(file.path()).unwrap();
        assert!(!map.was_cut());
        file.as_file().set_len(4096).unwrap();
        assert_eq!(map.bytes()[100], 5, "before the new end: the file's");
        map.fault_in(0, 4 * 4096);
        assert_eq!(map.bytes()[3 * 4096 + 7], 0, "past it: zeros, not SIGBUS");
        assert!(map.was_cut());
        let other = MappedFile::open(file.path()).unwrap();
        assert!(!other.was_cut(), "another mapping is not");
        drop(map);
        guard_truncation().unwrap();
    }

    #[test]
    fn maps_and_reports_residency() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(&vec![5u8; 3 * 4096 + 10]).unwrap();
        let map = MappedFile::open(file.path()).unwrap();
        assert_eq!(map.len(), 3 * 4096 + 10);
        assert!(map.bytes().iter().all(|&b| b == 5)); // touched, so resident
        assert!(map.is_resident(100, 3 * 4096));
        map.will_need(0, 100_000); // past the end is clamped
        let empty = tempfile::NamedTempFile::new().unwrap();
        assert!(MappedFile::open(empty.path()).unwrap().is_empty());
        // Held in memory: the length asked for (not the pages'), page-aligned, resident from the start.
        let held = MappedFile::in_memory(4097, |m| {
            assert_eq!(
                (m.len(), m.as_ptr() as usize % page_size()),
                (4097usize.div_ceil(page_size()) * page_size(), 0)
            );
            m[..4097].fill(7);
            Ok(())
        })
        .unwrap();
        assert_eq!((held.len(), held.bytes().iter().all(|&b| b == 7)), (4097, true));
        assert!(held.is_resident(0, 4097));
        assert!(MappedFile::in_memory(10, |_| Err(io::ErrorKind::UnexpectedEof.into())).is_err());
    }
}
