//! The few raw system calls the mount tool makes (fork, setsid, dup2, mount, umount2, memfd_create, the
//! memory files' tmpfs), each wrapped with its safety argument, and what the mount reads from `/proc`.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

/// Unmounts `path`; `lazy` detaches it now and cleans up when no longer busy (MNT_DETACH).
pub fn unmount(path: &Path, lazy: bool) -> io::Result<()> {
    let c = c_path(path)?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call; umount2 reads it only.
    let rc = unsafe { libc::umount2(c.as_ptr(), flags) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The id of the mount that `path` is on: the kernel's unique one where it has it (`STATX_MNT_ID_UNIQUE`,
/// Linux 6.8, never reused), else the one `/proc/self/mountinfo` shows (reused once that mount is gone).
/// Asks no filesystem there anything (`AT_STATX_DONT_SYNC`): a FUSE mount whose daemon is gone answers too.
pub fn mount_id(path: &Path) -> io::Result<u64> {
    let c = c_path(path)?;
    let mut stx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    let flags = libc::AT_STATX_DONT_SYNC | libc::AT_NO_AUTOMOUNT;
    let mask = libc::STATX_MNT_ID_UNIQUE | libc::STATX_MNT_ID;
    // SAFETY: `c` is a valid NUL-terminated string and `stx` a buffer of a `statx`, both outliving the call,
    // which writes nothing else.
    let rc = unsafe { libc::statx(libc::AT_FDCWD, c.as_ptr(), flags, mask, stx.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statx succeeded, and the buffer was zeroed before: every field is initialized.
    let stx = unsafe { stx.assume_init() };
    if stx.stx_mask & mask == 0 {
        return Err(io::Error::new(io::ErrorKind::Unsupported, "this kernel reports no mount id"));
    }
    Ok(stx.stx_mnt_id)
}

/// The process (thread group) that thread `tid` belongs to, from `/proc`; `None` once it has exited.
pub fn thread_group(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Tgid:")).and_then(|v| v.trim().parse().ok())
}

/// `/proc/PID/stat` from its third field (the state) on, each field one word: field `n` is word `n - 3`.
/// `None` once the process is gone.
pub fn stat_from_state(pid: u32) -> Option<String> {
    let mut stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
    stat.drain(..stat.rfind(')')? + 1);
    Some(stat)
}

/// When process `pid` started (clock ticks since boot, `/proc/PID/stat` field 22): with the pid, an
/// identity that a later process reusing the pid does not share. `None` once it has exited.
pub fn start_time(pid: u32) -> Option<u64> {
    stat_from_state(pid)?.split_whitespace().nth(19)?.parse().ok()
}

/// Descriptors that memory files leave free (half the limit, where it is lower): the mount's sockets,
/// the node cache's files, the FUSE threads' clones and the ledger need their own. A memory file that
/// would leave fewer is refused with `EMFILE` ([`short_of_descriptors`]): its body goes into a buffer,
/// its open through the daemon. Each cached object of a passthrough mount holds one, and a cache of
/// small objects would otherwise hold as many as the limit allows and then fail every fetch and open.
pub const DESCRIPTORS_KEPT: u64 = 512;

/// The soft limit of open files, as the process raised it at its start.
static OPEN_FILES_LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// Descriptors open at the last count of `/proc/self/fd`, plus one for each memory file made since: an
/// estimate never below the truth by more than what else opened since (closes are seen at the next
/// count, made every [`COUNT_EVERY`] memory files).
static OPEN_ESTIMATE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
const COUNT_EVERY: u64 = 64;
static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Descriptors this process has open now.
fn open_descriptors() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// `file`, a memory file just made, unless fewer than [`DESCRIPTORS_KEPT`] descriptors would be left
/// free. The descriptor's number alone says too little (the lowest free one is taken, below others
/// open), so the open descriptors are counted now and then.
fn within_descriptors(file: std::fs::File) -> io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::sync::atomic::Ordering;
    let limit = *OPEN_FILES_LIMIT.get_or_init(batchfs::process::open_files_limit);
    let room = limit.saturating_sub(DESCRIPTORS_KEPT.min(limit / 2));
    let mut open = OPEN_ESTIMATE.fetch_add(1, Ordering::Relaxed) + 1;
    if MADE.fetch_add(1, Ordering::Relaxed).is_multiple_of(COUNT_EVERY) {
        open = open_descriptors();
        OPEN_ESTIMATE.store(open, Ordering::Relaxed);
    }
    if open.max(file.as_raw_fd() as u64) >= room {
        return Err(io::Error::from_raw_os_error(libc::EMFILE));
    }
    Ok(file)
}

/// Whether `e` says the process (or the machine) has no descriptor to spare: the caller goes without a
/// memory file, once warned of it.
pub fn short_of_descriptors(e: &io::Error) -> bool {
    let short = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if short && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            limit = OPEN_FILES_LIMIT.get().copied().unwrap_or_else(batchfs::process::open_files_limit),
            "short of file descriptors: objects are cached without memory files and read through the daemon \
             (raise the hard limit of open files, `LimitNOFILE` or `ulimit -Hn`, for passthrough)"
        );
    }
    short
}

/// An anonymous memory-backed file (`memfd_create`), closed on exec, that [`seal`] can make immutable.
pub fn memfd(name: &str) -> io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let c = CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains NUL"))?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call; memfd_create only reads it.
    let fd = unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create, is open, and nothing else owns it.
    within_descriptors(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// The directory of a private tmpfs with transparent huge pages that memory files are made in, once
/// [`use_huge_pages`] has mounted it.
static HUGE_TMPFS: std::sync::OnceLock<std::os::fd::OwnedFd> = std::sync::OnceLock::new();

/// Makes [`memory_file`] create its files on a private tmpfs mounted with `huge=within_size` instead of
/// with `memfd_create`, whose files take 4 KiB pages unless the machine's `shmem_enabled` says otherwise
/// (`never` by default). Filling and freeing a memory file page by page was most of the mount's CPU
/// (allocating, charging and zeroing each 4 KiB page on write, removing each at the last close); a
/// 2 MiB page does that work once per 512.
///
/// The tmpfs is mounted on a fresh directory, opened, then detached at once (`MNT_DETACH`) and the
/// directory removed: no one else can see it, nothing is left behind when the process ends, and the
/// files stay reachable through the open directory. Needs `CAP_SYS_ADMIN` (root) and a kernel with
/// transparent huge pages; otherwise the error says why and memory files stay memfds. Its size limit
/// is the machine's memory: the cache's budget is what bounds it.
pub fn use_huge_pages() -> io::Result<()> {
    if HUGE_TMPFS.get().is_some() {
        return Ok(());
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!(".batchfs-memory-{}-{nanos}", std::process::id()));
    std::fs::create_dir(&dir)?;
    let mounted = mount_tmpfs(&dir, "huge=within_size,size=100%,mode=0700")
        .and_then(|()| {
            let opened = std::fs::File::open(&dir);
            let detached = unmount(&dir, true);
            let opened = opened?;
            detached?;
            Ok(opened)
        })
        .map(std::os::fd::OwnedFd::from);
    let _ = std::fs::remove_dir(&dir);
    let _ = HUGE_TMPFS.set(mounted?);
    Ok(())
}

/// Whether [`memory_file`] makes its files on the huge-page tmpfs.
pub fn huge_pages() -> bool {
    HUGE_TMPFS.get().is_some()
}

fn mount_tmpfs(dir: &Path, options: &str) -> io::Result<()> {
    let target = c_path(dir)?;
    let data = CString::new(options).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in options"))?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: every pointer is a valid NUL-terminated string that outlives the call; mount reads them only.
    let rc =
        unsafe { libc::mount(c"batchfs".as_ptr(), target.as_ptr(), c"tmpfs".as_ptr(), flags, data.as_ptr().cast()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A new memory file for `len` bytes, empty and positioned at 0, that [`seal`] makes read-only once
/// written: on the huge-page tmpfs once [`use_huge_pages`] succeeded (its size set to `len` first, so
/// that `huge=within_size` gives its whole 2 MiB spans huge pages; it reads as `len` bytes from then
/// on, so write all of them), else a [`memfd`] named `name`.
pub fn memory_file(name: &str, len: u64) -> io::Result<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let Some(dir) = HUGE_TMPFS.get() else {
        return memfd(name);
    };
    // SAFETY: the directory descriptor is open for the process's life (a static), "." is a valid
    // NUL-terminated string, and openat only reads it; the mode is an integer.
    let fd = unsafe {
        libc::openat(dir.as_raw_fd(), c".".as_ptr(), libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC, 0o600)
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by openat, is open, and nothing else owns it.
    let file = within_descriptors(unsafe { std::fs::File::from_raw_fd(fd) })?;
    file.set_len(len)?;
    Ok(file)
}

/// Makes a written [`memory_file`] immutable for good: a memfd is sealed (it can no longer be written,
/// grown, shrunk or unsealed by anyone holding it); a tmpfs file, which takes no seals, is reopened
/// read-only and its writable descriptor closed, so no descriptor that can write it remains.
pub fn seal(file: std::fs::File) -> io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open for the duration of the call (borrowed from `file`); F_GET_SEALS
    // takes no argument and touches no memory of ours.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals >= 0 && seals & libc::F_SEAL_SEAL == 0 {
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
        // SAFETY: as above; F_ADD_SEALS takes an integer argument and touches no memory of ours.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
        return if rc == 0 { Ok(file) } else { Err(io::Error::last_os_error()) };
    }
    // Not a sealable memfd: the same file (the same pages) through a read-only descriptor.
    reopen(&file, false)
}

/// Whether no one but the caller has `file`'s inode open or mapped: a write lease (`F_SETLEASE`) is
/// granted only when the inode's only open file (counting every descriptor and every mapping of any
/// process, and the files the kernel opens on a passthrough file's behalf) is the caller's `file`; it is
/// let go at once. A memory file the daemon evicted is written again only after this says so, so no
/// loader's mapping of it ever sees a byte change. `Ok(false)` when shared; an error where leases are
/// off (`fs.leases-enable`) or the file takes none.
pub fn unshared(file: &std::fs::File) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    // A lease makes its taker the file's owner: an open by anyone else while it is held (the instant
    // between taking and letting go) sends the owner SIGIO, whose default action ends the process.
    static QUIET: std::sync::Once = std::sync::Once::new();
    // SAFETY: SIG_IGN installs no handler (no code of ours runs in a signal context); nothing in the mount
    // asks for SIGIO (no other descriptor has an owner set), so ignoring it changes nothing else.
    QUIET.call_once(|| unsafe {
        libc::signal(libc::SIGIO, libc::SIG_IGN);
    });
    // SAFETY: the descriptor is open for the duration of the call (borrowed from `file`); F_SETLEASE
    // takes an integer argument and touches no memory of ours.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_WRLCK) } != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EBUSY) => Ok(false),
            _ => Err(e),
        };
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

/// A new open file of the inode `file` is open on (the same pages), read-only or also `writable`: opened
/// again through `/proc/self/fd`, so the new file counts as another open (a lease sees it).
pub fn reopen(file: &std::fs::File, writable: bool) -> io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    std::fs::OpenOptions::new().read(true).write(writable).open(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// Whether this process is root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The real user and group ids.
pub fn ids() -> (u32, u32) {
    // SAFETY: getuid and getgid have no preconditions and cannot fail.
    unsafe { (libc::getuid(), libc::getgid()) }
}

/// The outcome of [`fork`].
pub enum Forked {
    Parent,
    Child,
}

/// Forks, while the process has a single thread (no runtime started yet): with another one alive it
/// refuses, since the child could inherit a lock that thread held and wait on it for ever.
pub fn fork() -> io::Result<Forked> {
    let threads = std::fs::read_dir("/proc/self/task")?.count();
    if threads != 1 {
        return Err(io::Error::other(format!("cannot fork with {threads} threads running (one may hold a lock)")));
    }
    // SAFETY: the process has one thread (checked above; only this thread can start another), so the
    // child cannot inherit a lock held by a thread that no longer exists.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(Forked::Child),
        _ => Ok(Forked::Parent),
    }
}

/// Detaches from the controlling terminal and points stdin/stdout/stderr at `/dev/null`.
pub fn detach() -> io::Result<()> {
    let null = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null")?;
    use std::os::fd::AsRawFd;
    // SAFETY: setsid has no memory-safety preconditions; dup2 gets a descriptor we own (`null`, open for
    // the duration of the calls) and the standard descriptor numbers.
    unsafe {
        libc::setsid();
        for fd in 0..3 {
            if libc::dup2(null.as_raw_fd(), fd) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// CPU seconds (user + system) of this process's waited-for children.
pub fn children_cpu_seconds() -> Option<f64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: getrusage writes a whole `rusage` into the pointer it is given, which is valid for writes.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: getrusage returned 0, so it initialized `usage`.
    let u = unsafe { usage.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Some(secs(u.ru_utime) + secs(u.ru_stime))
}

/// Clock ticks per second, the unit of `/proc`'s CPU times (100 where sysconf says nothing).
pub fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// Makes the allocator return large buffers to the system as soon as they are freed: batch bodies of
/// several MB come and go all the time, and glibc's adaptive mmap threshold would otherwise serve them
/// from heap arenas that keep the freed memory, growing RSS well past the cache budget.
pub fn release_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning parameters; it is called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
    }
}

/// The span of a transparent huge page on x86-64 and most arm64 kernels.
const HUGE_PAGE: usize = 2 << 20;

/// An empty buffer of `capacity` bytes whose whole, aligned 2 MiB spans the kernel may back with
/// transparent huge pages (`MADV_HUGEPAGE`: the machine's default, `madvise`, gives them only to memory
/// that asks). A fresh body buffer is a fresh mapping (above malloc's mmap threshold): filling it took a
/// page fault, a zeroed page and a memory-cgroup charge every 4 KiB, 11 % of the daemon's CPU in a
/// mount's first epoch of `shuffled/` (docs/BENCHMARKS.md); a huge page does that once per 512. Where
/// the kernel has no huge pages, or they are off, the advice does nothing.
pub fn huge_buffer(capacity: usize) -> Vec<u8> {
    let buf: Vec<u8> = Vec::with_capacity(capacity);
    #[cfg(target_os = "linux")]
    {
        let start = buf.as_ptr() as usize;
        let (from, to) = (start.next_multiple_of(HUGE_PAGE), (start + buf.capacity()) / HUGE_PAGE * HUGE_PAGE);
        if to > from {
            // SAFETY: advice only, on whole pages within this buffer's own allocation, none touched yet:
            // the kernel may back them with huge pages at their first touch; their contents are unchanged.
            unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE) };
        }
    }
    buf
}

/// Gives back what this process no longer uses of what the checks before mounting touched: the heap's free
/// memory, and the pages of read-only file mappings (the program's and libraries' code and constants,
/// faulted in again from the page cache if they are run again). For the supervisor, whose loop uses little
/// of the program; never for a writable mapping (its pages would be lost).
pub fn shed_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else { return };
    // Each mapping: its header line (start-end perms offset dev inode path), then its counters. Only
    // mappings all of whose pages are the file's own are dropped: a read-only mapping may hold pages
    // written before it was made read-only (relocations), which the file does not have.
    let mut candidate: Option<(usize, usize)> = None;
    let mut clean = true;
    let flush = |candidate: Option<(usize, usize)>, clean: bool| {
        if let (Some((a, b)), true) = (candidate, clean) {
            // SAFETY: a read-only, file-backed mapping of this process none of whose pages differ from
            // the file: dropping them loses nothing (they are read again from the file at the next touch).
            unsafe { libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_DONTNEED) };
        }
    };
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let Some(first) = f.next() else { continue };
        if let Some((a, b)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
            flush(candidate.take(), clean);
            clean = true;
            let perms = f.next().unwrap_or("");
            let path = f.nth(3).unwrap_or("");
            if path.starts_with('/') && perms.starts_with('r') && !perms.contains('w') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                    candidate = Some((a, b));
                }
            }
        } else if matches!(first, "Private_Dirty:" | "Anonymous:" | "Swap:") && f.next() != Some("0") {
            clean = false;
        }
    }
    flush(candidate, clean);
}

/// Registers `file` as a backing file of the FUSE connection `device` (`FUSE_DEV_IOC_BACKING_OPEN`,
/// Linux 6.9): its backing id, for an open's reply to name ([`close_backing`] closes it).
pub fn open_backing(device: std::os::fd::BorrowedFd<'_>, file: std::os::fd::BorrowedFd<'_>) -> io::Result<u32> {
    use std::os::fd::AsRawFd;
    /// `struct fuse_backing_map` of `<linux/fuse.h>`.
    #[repr(C)]
    struct BackingMap {
        fd: i32,
        flags: u32,
        padding: u64,
    }
    // _IOW(229, 1, struct fuse_backing_map)
    const FUSE_DEV_IOC_BACKING_OPEN: libc::c_ulong = 0x4010_e501;
    let map = BackingMap { fd: file.as_raw_fd(), flags: 0, padding: 0 };
    // SAFETY: the ioctl reads the map through the pointer, which outlives the call; the descriptors are
    // borrowed, open for its duration.
    let rc = unsafe { libc::ioctl(device.as_raw_fd(), FUSE_DEV_IOC_BACKING_OPEN as _, &map as *const BackingMap) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc as u32)
}

/// Closes backing id `id` of the FUSE connection `device` (`FUSE_DEV_IOC_BACKING_CLOSE`).
pub fn close_backing(device: std::os::fd::BorrowedFd<'_>, id: u32) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // _IOW(229, 2, uint32_t)
    const FUSE_DEV_IOC_BACKING_CLOSE: libc::c_ulong = 0x4004_e502;
    // SAFETY: the ioctl reads one u32 through the pointer, which outlives the call.
    let rc = unsafe { libc::ioctl(device.as_raw_fd(), FUSE_DEV_IOC_BACKING_CLOSE as _, &id as *const u32) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Asks the kernel to send again every request of the FUSE connection `device` that was read and not
/// answered (`FUSE_NOTIFY_RESEND`, Linux 6.9: a worker that read them died).
pub fn notify_resend(device: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // struct fuse_out_header { len: u32, error: i32 (the notify code), unique: u64 (0: a notification) }
    const FUSE_NOTIFY_RESEND: i32 = 7;
    let mut header = [0u8; 16];
    header[..4].copy_from_slice(&16u32.to_ne_bytes());
    header[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_ne_bytes());
    // SAFETY: writes the 16 bytes of `header`, which outlives the call.
    let n = unsafe { libc::write(device.as_raw_fd(), header.as_ptr().cast(), header.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Requests [`fail_queued`] reads at most in one call: readers that retry at once on `EIO` keep the queue
/// from emptying, and the supervisor must get back to its signals (a worker's death, SIGTERM).
pub const FAILED_AT_MOST: usize = 4096;
/// How long one call of [`fail_queued`] goes on at most, for the same reason.
pub const FAILING_AT_MOST: std::time::Duration = std::time::Duration::from_millis(100);

/// Answers the requests queued on the FUSE connection `device` now with `EIO` (none is waited for): what a
/// supervisor does while no worker can serve its mount, so that no reader waits for good. They are read
/// through a clone of the connection's descriptor of its own, made non-blocking (the connection's own
/// descriptor is the workers' too, and must stay blocking), and answered through it. Requests that take
/// no answer (`FORGET`, `BATCH_FORGET`, `INTERRUPT`, `NOTIFY_REPLY`) are dropped. `buffer` holds the
/// largest request (the kernel refuses a read into less). Reads at most [`FAILED_AT_MOST`] requests, for
/// at most [`FAILING_AT_MOST`]: what is left waits for the next call. Returns how many were answered.
pub fn fail_queued(device: std::os::fd::BorrowedFd<'_>, buffer: &mut [u8]) -> io::Result<usize> {
    use std::os::fd::{AsFd, AsRawFd};
    let clone = clone_fuse(device)?;
    let fd = clone.as_raw_fd();
    // SAFETY: fcntl reads and sets the status flags of a descriptor this function holds open.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    fail_requests(clone.as_fd(), buffer, FAILED_AT_MOST, FAILING_AT_MOST)
}

/// [`fail_queued`]'s loop on `fd` (non-blocking): reads and answers requests until none is queued, `most`
/// were read or `time` has passed.
fn fail_requests(
    fd: std::os::fd::BorrowedFd<'_>,
    buffer: &mut [u8],
    most: usize,
    time: std::time::Duration,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    const UNANSWERED: [u32; 4] =
        [2 /* FORGET */, 36 /* INTERRUPT */, 41 /* NOTIFY_REPLY */, 42 /* BATCH_FORGET */];
    let fd = fd.as_raw_fd();
    let until = std::time::Instant::now() + time;
    let mut answered = 0;
    for _ in 0..most {
        if std::time::Instant::now() >= until {
            break;
        }
        // SAFETY: reads at most `buffer.len()` bytes into `buffer`, which outlives the call.
        let n = unsafe { libc::read(fd, buffer.as_mut_ptr().cast(), buffer.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // Nothing more queued.
                Some(libc::EAGAIN) => return Ok(answered),
                // The request was interrupted meanwhile.
                Some(libc::ENOENT | libc::EINTR) => continue,
                _ => return Err(e),
            }
        }
        // struct fuse_in_header { len: u32, opcode: u32, unique: u64, ... }
        if (n as usize) < 16 {
            continue;
        }
        let opcode = u32::from_ne_bytes(buffer[4..8].try_into().expect("4 bytes"));
        let unique = u64::from_ne_bytes(buffer[8..16].try_into().expect("8 bytes"));
        if UNANSWERED.contains(&opcode) {
            continue;
        }
        // struct fuse_out_header { len: u32, error: i32, unique: u64 }
        let mut header = [0u8; 16];
        header[..4].copy_from_slice(&16u32.to_ne_bytes());
        header[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
        header[8..].copy_from_slice(&unique.to_ne_bytes());
        // SAFETY: writes the 16 bytes of `header`, which outlives the call.
        if unsafe { libc::write(fd, header.as_ptr().cast(), header.len()) } == 16 {
            answered += 1;
        }
    }
    Ok(answered)
}

/// A new descriptor of the FUSE connection `device` that reads requests of its own
/// (`FUSE_DEV_IOC_CLONE`): what it read and did not answer fails when it closes, instead of staying with
/// the connection.
pub fn clone_fuse(device: std::os::fd::BorrowedFd<'_>) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    // _IOR(229, 0, uint32_t)
    const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;
    let clone = std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse")?;
    let source = device.as_raw_fd() as u32;
    // SAFETY: the ioctl reads one u32 through the pointer, which outlives the call.
    let rc = unsafe { libc::ioctl(clone.as_raw_fd(), FUSE_DEV_IOC_CLONE as _, &source as *const u32) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(clone.into())
}

/// Sends `message` on `socket` to `target`, with descriptor `fd` attached (`SCM_RIGHTS`) if given: how a
/// service hands systemd a descriptor to keep.
pub fn send_with_fd(
    socket: &std::os::unix::net::UnixDatagram,
    target: &std::os::unix::net::SocketAddr,
    message: &[u8],
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    socket.connect_addr(target)?;
    let mut iov = libc::iovec { iov_base: message.as_ptr() as *mut libc::c_void, iov_len: message.len() };
    // Room for one descriptor's control message, aligned as cmsghdr.
    let mut control = [0u64; 4];
    // SAFETY: msghdr is plain data; the pointers set below (iov, control) outlive the sendmsg call, and
    // the control message is written within `control` (CMSG_SPACE of one int fits in 32 bytes).
    unsafe {
        let mut msg = std::mem::zeroed::<libc::msghdr>();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = fd {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(4) as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(4) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>(), fd.as_raw_fd());
        }
        if libc::sendmsg(socket.as_raw_fd(), &msg, 0) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    /// Readers that retry at once on `EIO` keep the queue from emptying (here `/dev/zero`, a queue that never
    /// empties: every read a request, every answer taken): one call still returns, after its count of
    /// requests or its time, so the supervisor gets back to its signals. Unbounded, it never returned.
    #[test]
    fn failing_queued_requests_stops_at_its_bounds_however_many_keep_coming() {
        use std::os::fd::AsFd;
        use std::time::{Duration, Instant};
        let zero = std::fs::OpenOptions::new().read(true).write(true).open("/dev/zero").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buffer = vec![0u8; 64];
            let by_count = fail_requests(zero.as_fd(), &mut buffer, 1000, Duration::from_secs(3600)).unwrap();
            let start = Instant::now();
            let by_time = fail_requests(zero.as_fd(), &mut buffer, usize::MAX, Duration::from_millis(50)).unwrap();
            tx.send((by_count, by_time, start.elapsed())).unwrap();
        });
        let (by_count, by_time, took) = rx.recv_timeout(Duration::from_secs(20)).expect("it never returned");
        assert_eq!(by_count, 1000);
        assert!(by_time > 0 && took < Duration::from_secs(5), "{by_time} in {took:?}");
    }

    /// Whether the kernel may back the page at `addr` with transparent huge pages (`THPeligible` of the
    /// mapping that holds it, in `/proc/self/smaps`).
    fn huge_eligible(addr: usize) -> bool {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
                let (a, b) = (usize::from_str_radix(a, 16).unwrap(), usize::from_str_radix(b, 16).unwrap());
                inside = (a..b).contains(&addr);
            } else if inside && line.starts_with("THPeligible:") {
                return line.split_whitespace().nth(1) == Some("1");
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    #[test]
    fn a_body_buffer_asks_for_huge_pages() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if !thp.contains("[madvise]") && !thp.contains("[always]") {
            eprintln!("skipped: transparent huge pages are off here ({})", thp.trim());
            return;
        }
        let mut huge = huge_buffer(16 << 20);
        let aligned = (huge.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
        assert!(huge_eligible(aligned), "the buffer's whole 2 MiB spans are advised");
        if thp.contains("[madvise]") {
            // A fresh mapping of its own, not advised (a Vec here may come from memory malloc reused, which
            // a test before may have advised: the test binary leaves malloc's mmap threshold dynamic).
            let len = 16 << 20;
            // SAFETY: a new private anonymous mapping, unmapped below; nothing else refers to it.
            let plain = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(plain, libc::MAP_FAILED);
            let eligible = huge_eligible((plain as usize).next_multiple_of(HUGE_PAGE));
            // SAFETY: the mapping made above, of `len` bytes, unused since.
            unsafe { libc::munmap(plain, len) };
            assert!(!eligible, "without the advice, no huge pages under `madvise`");
        }
        // The advice changes nothing of what the buffer holds.
        huge.extend(std::iter::repeat_n(7u8, 16 << 20));
        assert!(huge.iter().all(|&b| b == 7) && huge.len() == 16 << 20);
        assert!(huge_buffer(4096).capacity() >= 4096, "too small for a huge page: a plain buffer");
    }

    #[test]
    fn threads_map_to_their_process() {
        let me = std::process::id();
        assert_eq!(thread_group(me), Some(me));
        let (tid, group) = std::thread::spawn(|| {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() } as u32;
            (tid, thread_group(tid))
        })
        .join()
        .unwrap();
        assert_ne!(tid, me, "a thread has an id of its own");
        assert_eq!(group, Some(me), "and belongs to this process");
    }

    #[test]
    fn a_process_start_time_is_its_own() {
        let me = start_time(std::process::id()).unwrap();
        assert_eq!(start_time(std::process::id()), Some(me), "stable");
        let child = std::process::Command::new("sleep").arg("1").spawn().unwrap();
        let theirs = start_time(child.id()).unwrap();
        assert!(theirs >= me, "started later: {theirs} < {me}");
        assert_eq!(start_time(u32::MAX), None);
        let mut child = child;
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A fork with another thread alive could leave the child a lock that thread held (a DNS lookup
    /// still running on a runtime's blocking pool): `fork` refuses, and the mount forks before it
    /// starts any thread.
    #[test]
    fn fork_refuses_while_another_thread_runs() {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || stopped.recv());
        let forked = fork();
        if let Ok(Forked::Child) = forked {
            // SAFETY: the child of a fork that should not have happened leaves at once.
            unsafe { libc::_exit(0) }
        }
        assert!(forked.is_err(), "forked with another thread alive");
        drop(stop);
        let _ = other.join();
    }

    /// As root, memory files come from the private huge-page tmpfs: nothing of it is visible in the
    /// mount table, a file reads back what was written (by reads and its mapping), and once sealed no
    /// descriptor of it can write. (Others keep memfds: the call then says why.)
    #[test]
    fn memory_files_on_the_huge_page_tmpfs_hold_what_is_written_and_are_read_only_once_sealed() {
        if !is_root() {
            assert!(use_huge_pages().is_err(), "mounting a tmpfs needs CAP_SYS_ADMIN");
            return;
        }
        use_huge_pages().unwrap();
        assert!(huge_pages());
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mounts.contains(".batchfs-memory-"), "the tmpfs is detached at once");
        let data: Vec<u8> = (0..(6u32 << 20)).map(|i| (i % 251) as u8).collect();
        let mut f = memory_file("batchfs-test", data.len() as u64).unwrap();
        for piece in data.chunks(100_000) {
            f.write_all(piece).unwrap();
        }
        let mut f = seal(f).unwrap();
        assert!(f.write_all(b"more").is_err(), "read-only once sealed");
        let mut back = Vec::new();
        f.rewind().unwrap();
        f.read_to_end(&mut back).unwrap();
        assert!(back == data, "reads back what was written");
        let map = batchfs::mmap::MappedFile::open_file(&f).unwrap();
        assert!(map.bytes() == &data[..], "and so does its mapping");
    }

    /// The lease says a file is shared while another descriptor or a mapping of it lives, in this
    /// process or another, and unshared once they are gone; the caller's own mapping of its own
    /// descriptor does not count.
    #[test]
    fn a_file_is_unshared_only_when_no_other_descriptor_or_mapping_holds_it() {
        let f = memfd("batchfs-test").unwrap();
        f.set_len(1 << 20).unwrap();
        let f = reopen(&f, false).unwrap();
        assert!(unshared(&f).unwrap(), "alone");
        // SAFETY: a null new action only reads the current one into `old`, which outlives the call.
        let old = unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGIO, std::ptr::null(), &mut old);
            old
        };
        assert_eq!(old.sa_sigaction, libc::SIG_IGN, "a lease broken while held would end the process");
        let own = batchfs::mmap::MappedFile::open_file(&f).unwrap();
        assert!(unshared(&f).unwrap(), "its own mapping");
        drop(own);
        let other = reopen(&f, false).unwrap();
        assert!(!unshared(&f).unwrap(), "another descriptor");
        let mapped = batchfs::mmap::MappedFile::open_file(&other).unwrap();
        drop(other);
        assert!(!unshared(&f).unwrap(), "a mapping whose descriptor is closed");
        drop(mapped);
        assert!(unshared(&f).unwrap(), "all gone");
        let w = reopen(&f, true).unwrap();
        assert!(!unshared(&f).unwrap(), "a writable descriptor");
        drop(w);
        assert!(unshared(&f).unwrap());
    }

    #[test]
    fn memfds_hold_what_is_written() {
        let mut f = memfd("batchfs-test").unwrap();
        f.write_all(b"batch bytes").unwrap();
        let mut f = seal(f).unwrap();
        assert!(f.write_all(b"more").is_err(), "sealed: no more writes");
        f.rewind().unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "batch bytes");
    }
}
