//! The few raw system calls the mount tool makes (fork, setsid, dup2, umount2, memfd_create), each
//! wrapped with its safety argument, and what the mount reads from `/proc`.

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

/// The process (thread group) that thread `tid` belongs to, from `/proc`; `None` once it has exited.
pub fn thread_group(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Tgid:")).and_then(|v| v.trim().parse().ok())
}

/// When process `pid` started (clock ticks since boot, `/proc/PID/stat` field 22): with the pid, an
/// identity that a later process reusing the pid does not share. `None` once it has exited.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
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
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Makes a [`memfd`] immutable for good: it can no longer be written, grown, shrunk or unsealed.
pub fn seal(file: &std::fs::File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: the descriptor is open for the duration of the call (borrowed from `file`); F_ADD_SEALS
    // takes an integer argument and touches no memory of ours.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

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

    #[test]
    fn memfds_hold_what_is_written() {
        let mut f = memfd("batchfs-test").unwrap();
        f.write_all(b"batch bytes").unwrap();
        seal(&f).unwrap();
        assert!(f.write_all(b"more").is_err(), "sealed: no more writes");
        f.rewind().unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "batch bytes");
    }
}
