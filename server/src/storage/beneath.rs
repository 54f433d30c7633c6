//! A local dataset's files opened beneath its directory, so that a link swapped into the dataset after it
//! was indexed cannot make the server read, and send, a file outside it.
//!
//! Indexing follows symbolic links (docs/FORMATS.md): those that stay in the dataset's directory always,
//! those that lead out of it only with `--follow-links`. The server then opens each file by its indexed
//! path: every shard once as the storage opens, and each file of a tree too large to map, or beside the
//! shards (`raw/`), at each read. Resolved again then, a path may lead elsewhere: a file replaced by a link
//! to `/etc/shadow`, or a directory on its path by a link out, given the indexed file's size and date
//! (all that `storage.rs` compares). So every open of a dataset's file goes through [`DatasetDir`]:
//!
//! - `openat2(2)` from the directory, held open since the storage opened, with `RESOLVE_BENEATH |
//!   RESOLVE_NO_MAGICLINKS`: a path whose every link stays inside opens as before, in one system call.
//! - Refused there (`EXDEV`: an absolute link, or one that leaves and comes back), the path is opened
//!   `O_PATH` (which reads nothing and waits on nothing), and the file that came up is judged by its own
//!   path (`/proc/self/fd/N`) against the directory's own. Inside, it is opened again through that
//!   descriptor, so the file judged is the file read. Out of the directory it is refused
//!   ([`BeneathError::Outside`]), unless the dataset follows links out and it is the very file (device
//!   and inode) that the path led to when the storage opened ([`DatasetDir::open_first`] records those);
//!   another file out there is refused too ([`BeneathError::Elsewhere`]).
//! - Where the kernel has no `openat2` (`ENOSYS`: Linux before 5.6, or a seccomp filter that does not know
//!   it; `EPERM`: the filter of container runtimes before 2021, Docker 20.10's among them, which refuses
//!   system calls it does not know so), every open takes that second way, as safe and a few system calls
//!   dearer; the log says so once.
//!
//! A refusal is a change of the dataset: `storage.rs` refuses the file's batches and reads from then on,
//! until a restart indexes the dataset again.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Why a file of a local dataset cannot be opened beneath the dataset's directory.
#[derive(Debug, thiserror::Error)]
pub enum BeneathError {
    #[error("cannot open the dataset's directory {root}: {source}")]
    Root { root: PathBuf, source: io::Error },
    /// `path` is the file's path in the dataset (the server's own layout is not told to clients).
    #[error(
        "{path} leads out of the dataset's directory: not served (a link out of it is followed only with \
         --follow-links, and only to the file it led to when the server started)"
    )]
    Outside { path: String },
    #[error("{path} leads out of the dataset's directory to another file than when the server started: not served")]
    Elsewhere { path: String },
    #[error("{path} is no regular file now (a FIFO, a device, a socket...): not served")]
    NotAFile { path: String },
    #[error("cannot open {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

impl BeneathError {
    /// Whether the file now leads somewhere it may not: a change of the dataset, not a failure to open.
    pub fn is_link_out(&self) -> bool {
        matches!(self, BeneathError::Outside { .. } | BeneathError::Elsewhere { .. } | BeneathError::NotAFile { .. })
    }
}

/// A file as the kernel knows it, whatever its names: device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
}

/// What a path may lead to out of the dataset's directory.
#[derive(Clone, Copy)]
enum Out {
    Refused,
    Only(FileId),
    Any,
}

/// A local dataset's directory, held open, and the files of it that lead out of it by links followed.
pub struct DatasetDir {
    /// The directory as configured, for messages and paths shown.
    path: PathBuf,
    /// The directory itself (`O_PATH`): what every path is resolved beneath.
    dir: OwnedFd,
    /// Links out of the directory are followed (`--follow-links`).
    follow_links: bool,
    /// By file number, the files out of the directory that links led to when the storage opened.
    outside: HashMap<u32, FileId>,
    /// The kernel refused `openat2` (`ENOSYS`): every open takes the second way.
    no_openat2: AtomicBool,
}

impl DatasetDir {
    /// Holds `path` open; links out of it are followed as `follow_links` says (see the module note).
    pub fn open(path: &Path, follow_links: bool) -> Result<DatasetDir, BeneathError> {
        let root = |source| BeneathError::Root { root: path.to_owned(), source };
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
            .open(path)
            .map_err(root)?;
        let (path, dir) = (path.to_owned(), OwnedFd::from(dir));
        Ok(DatasetDir { path, dir, follow_links, outside: HashMap::new(), no_openat2: AtomicBool::new(false) })
    }

    /// The directory as configured.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File `n` of the dataset, at `rel` beneath the directory, opened with `flags` (`O_RDONLY`, perhaps
    /// `O_DIRECT`, or `O_PATH`) as the storage opens it at start: where links out are followed, a file out
    /// of the directory is taken, and recorded as the one file its path may lead to from then on.
    pub fn open_first(&mut self, n: u32, rel: &str, flags: libc::c_int) -> Result<File, BeneathError> {
        let out = if self.follow_links { Out::Any } else { Out::Refused };
        let (file, outside) = self.opened(rel, flags, out)?;
        if let Some(id) = outside {
            self.outside.insert(n, id);
        }
        Ok(file)
    }

    /// File `n` of the dataset, at `rel` beneath the directory, opened with `flags` to be read now: inside
    /// the directory, or the very file out of it that [`DatasetDir::open_first`] recorded.
    pub fn open_file(&self, n: u32, rel: &str, flags: libc::c_int) -> Result<File, BeneathError> {
        let out = self.outside.get(&n).map_or(Out::Refused, |&id| Out::Only(id));
        Ok(self.opened(rel, flags, out)?.0)
    }

    /// `rel` opened with `flags`, and the file it is where that is out of the directory: a regular file,
    /// opened for reading without waiting (a FIFO swapped in blocked its open for good).
    fn opened(&self, rel: &str, flags: libc::c_int, out: Out) -> Result<(File, Option<FileId>), BeneathError> {
        let (file, outside) = self.opened_any(rel, reading(flags), out)?;
        if flags & libc::O_PATH != 0 {
            return Ok((file, outside));
        }
        let io = |source| BeneathError::Io { path: self.path.join(rel), source };
        if !file.metadata().map_err(io)?.is_file() {
            tracing::warn!(dir = %self.path.display(), path = rel, "no regular file");
            return Err(BeneathError::NotAFile { path: rel.to_owned() });
        }
        batchfs::fd::clear_nonblock(&file).map_err(io)?;
        Ok((file, outside))
    }

    /// [`DatasetDir::opened`] of whatever file `rel` is.
    fn opened_any(&self, rel: &str, flags: libc::c_int, out: Out) -> Result<(File, Option<FileId>), BeneathError> {
        let io = |source| BeneathError::Io { path: self.path.join(rel), source };
        let name = CString::new(rel).map_err(|e| io(e.into()))?;
        // `EAGAIN`: a rename elsewhere raced a `..` of the path; asked again, then taken the second way.
        for _ in 0..3 {
            if self.no_openat2.load(Ordering::Relaxed) {
                break;
            }
            match openat2(&self.dir, &name, flags) {
                Ok(fd) => return Ok((File::from(fd), None)),
                Err(e) => match e.raw_os_error() {
                    Some(libc::EXDEV) => break,
                    Some(libc::EAGAIN) => {}
                    // No open of ours is refused `EPERM` for its file (no `O_NOATIME`, no write): the system
                    // call is, by a seccomp filter. A file an LSM refuses so is refused the second way too.
                    Some(errno @ (libc::ENOSYS | libc::EPERM)) => {
                        if !self.no_openat2.swap(true, Ordering::Relaxed) {
                            let error = io::Error::from_raw_os_error(errno);
                            tracing::warn!(dir = %self.path.display(), %error,
                                "openat2 is refused here (an old kernel, or a container's seccomp filter): each file \
                                 of the dataset is opened by its path and judged by where it is before it is read");
                        }
                    }
                    _ => return Err(io(e)),
                },
            }
        }
        // Every link followed, nothing read: the file that came up, judged by where it is.
        let found = openat(&self.dir, &name, libc::O_PATH).map_err(io)?;
        let (to, inside) = (fd_path(&found).map_err(io)?, fd_path(&self.dir).map_err(io)?);
        let outside = match to.starts_with(&inside) {
            true => None,
            false => {
                let meta = File::from(found.try_clone().map_err(io)?).metadata().map_err(io)?;
                let id = FileId { dev: meta.dev(), ino: meta.ino() };
                let path = rel.to_owned();
                match out {
                    Out::Any => Some(id),
                    Out::Only(want) if want == id => Some(id),
                    Out::Only(_) => {
                        tracing::warn!(dir = %self.path.display(), path, to = %to.display(), "a link out, changed");
                        return Err(BeneathError::Elsewhere { path });
                    }
                    Out::Refused => {
                        tracing::warn!(dir = %self.path.display(), path, to = %to.display(), "a link out");
                        return Err(BeneathError::Outside { path });
                    }
                }
            }
        };
        if flags & libc::O_PATH != 0 {
            return Ok((File::from(found), outside));
        }
        // Opened again through its descriptor (a magic link of our own): no path is resolved again.
        let again = Path::new("/proc/self/fd").join(found.as_raw_fd().to_string());
        let file = std::fs::OpenOptions::new().read(true).custom_flags(flags).open(again).map_err(io)?;
        Ok((file, outside))
    }

    /// Takes the second way for every open, as where the kernel has no `openat2` (tests).
    #[cfg(test)]
    fn without_openat2(self) -> Self {
        self.no_openat2.store(true, Ordering::Relaxed);
        self
    }
}

/// `flags` for an open that never waits (`O_NONBLOCK`: a FIFO opens at once), where it reads.
fn reading(flags: libc::c_int) -> libc::c_int {
    if flags & libc::O_PATH != 0 {
        flags
    } else {
        flags | libc::O_NONBLOCK
    }
}

/// Where the file behind `fd` is now, as the kernel names it.
fn fd_path(fd: &OwnedFd) -> io::Result<PathBuf> {
    std::fs::read_link(Path::new("/proc/self/fd").join(fd.as_raw_fd().to_string()))
}

/// `struct open_how` of `<linux/openat2.h>` (libc's cannot be built outside libc: it is non-exhaustive).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `openat2(dir, name, flags)` resolving nothing out of `dir` and no magic link.
fn openat2(dir: &OwnedFd, name: &CString, flags: libc::c_int) -> io::Result<OwnedFd> {
    let resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    let how = OpenHow { flags: (flags | libc::O_CLOEXEC) as u64, mode: 0, resolve };
    // SAFETY: `name` is a NUL-terminated string and `how` a `struct open_how` of the size passed, both
    // alive for the call, which only reads them; `dir` is a descriptor open for the call's duration.
    let fd = unsafe {
        libc::syscall(libc::SYS_openat2, dir.as_raw_fd(), name.as_ptr(), &how, std::mem::size_of::<OpenHow>())
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// `openat(dir, name, flags)`, links followed wherever they lead.
fn openat(dir: &OwnedFd, name: &CString, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: `name` is a NUL-terminated string alive for the call; `dir` is open for its duration.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::symlink;

    /// A dataset's directory `ds` holding `a`, `sub/b` and `sub/c`, beside a directory `out` holding
    /// `secret` and `sub/b`, and the directory `ds` held open as `follow_links` says, with or without
    /// `openat2`.
    fn layout(follow_links: bool, with_openat2: bool) -> (tempfile::TempDir, DatasetDir) {
        let top = tempfile::tempdir().unwrap();
        for (path, bytes) in
            [("ds/a", "a"), ("ds/sub/b", "b"), ("ds/sub/c", "c"), ("out/secret", "s"), ("out/sub/b", "s")]
        {
            let path = top.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, bytes).unwrap();
        }
        let dir = DatasetDir::open(&top.path().join("ds"), follow_links).unwrap();
        (top, if with_openat2 { dir } else { dir.without_openat2() })
    }

    fn read(file: File) -> String {
        let mut text = String::new();
        { file }.read_to_string(&mut text).unwrap();
        text
    }

    /// Links that stay in the directory open as the index saw them, whatever their form: relative, absolute,
    /// to a directory, out and back in; `O_PATH` too (a look at a file of a tree at start).
    #[test]
    fn links_that_stay_in_the_directory_are_followed() {
        for with_openat2 in [true, false] {
            let (top, mut dir) = layout(false, with_openat2);
            let ds = top.path().join("ds");
            symlink("sub/b", ds.join("rel")).unwrap();
            symlink(ds.join("sub/b"), ds.join("abs")).unwrap();
            symlink("sub", ds.join("dir")).unwrap();
            symlink(ds.join("sub"), ds.join("absdir")).unwrap();
            symlink("../ds/sub/c", ds.join("back")).unwrap();
            let want = [("a", "a"), ("rel", "b"), ("abs", "b"), ("dir/b", "b"), ("absdir/c", "c"), ("back", "c")];
            for (n, (path, bytes)) in (0..).zip(want) {
                assert_eq!(read(dir.open_first(n, path, libc::O_RDONLY).unwrap()), bytes, "{path}");
                assert_eq!(read(dir.open_file(n, path, libc::O_RDONLY).unwrap()), bytes, "{path}");
                assert!(dir.open_file(n, path, libc::O_PATH).unwrap().metadata().unwrap().is_file(), "{path}");
            }
            assert!(dir.outside.is_empty());
        }
    }

    /// A file, or a directory on a file's path, replaced by a link out of the directory is refused, however
    /// the link is written (a magic link of `/proc` included), and the bytes out there are never opened.
    #[test]
    fn a_link_out_swapped_in_after_start_is_refused() {
        for (follow_links, with_openat2) in [(false, true), (false, false), (true, true), (true, false)] {
            let (top, mut dir) = layout(follow_links, with_openat2);
            let (ds, out) = (top.path().join("ds"), top.path().join("out"));
            for (n, path) in [(0, "a"), (1, "sub/b")] {
                dir.open_first(n, path, libc::O_RDONLY).unwrap();
            }
            std::fs::remove_file(ds.join("a")).unwrap();
            symlink(out.join("secret"), ds.join("a")).unwrap();
            std::fs::rename(ds.join("sub"), top.path().join("moved")).unwrap();
            symlink("../out/sub", ds.join("sub")).unwrap();
            for (n, path) in [(0, "a"), (1, "sub/b")] {
                let refused = dir.open_file(n, path, libc::O_RDONLY).unwrap_err();
                assert!(matches!(&refused, BeneathError::Outside { path: p } if p == path), "{refused:?}");
                assert!(refused.is_link_out() && refused.to_string().contains("--follow-links"), "{refused}");
            }
            std::fs::remove_file(ds.join("a")).unwrap();
            symlink(format!("/proc/self/root{}", out.join("secret").display()), ds.join("a")).unwrap();
            assert!(matches!(dir.open_file(0, "a", libc::O_RDONLY), Err(BeneathError::Outside { .. })));
            // A file that is not there is no link out: an error of its own.
            let gone = dir.open_file(2, "nothing", libc::O_RDONLY).unwrap_err();
            assert!(matches!(&gone, BeneathError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound));
        }
    }

    /// Where links out are followed (`--follow-links`), a file reached out of the directory at start is
    /// served, through the link made again too (`ln -sf`); another file out there is refused.
    /// A FIFO swapped in for a file (or linked to from inside) is refused at once as no regular file: its
    /// open waited for a writer for good, holding a thread of the server's; a file read is opened as
    /// before, its reads waiting as they should (no `O_NONBLOCK` left on it).
    #[test]
    fn a_fifo_swapped_in_is_refused_at_once_never_waited_on() {
        for with_openat2 in [true, false] {
            let (top, mut dir) = layout(false, with_openat2);
            let ds = top.path().join("ds");
            dir.open_first(0, "a", libc::O_RDONLY).unwrap();
            std::fs::remove_file(ds.join("a")).unwrap();
            let fifo = CString::new(ds.join("a").into_os_string().into_encoded_bytes()).unwrap();
            // SAFETY: a NUL-terminated path, alive for the call.
            assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
            let started = std::time::Instant::now();
            let refused = dir.open_file(0, "a", libc::O_RDONLY).unwrap_err();
            assert!(matches!(&refused, BeneathError::NotAFile { path } if path == "a"), "{refused:?}");
            assert!(refused.is_link_out(), "a change of the dataset");
            assert!(started.elapsed() < std::time::Duration::from_secs(5));
            let file = dir.open_file(1, "sub/b", libc::O_RDONLY).unwrap();
            // SAFETY: an open descriptor, its status flags read only.
            assert_eq!(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) } & libc::O_NONBLOCK, 0);
            assert_eq!(read(file), "b");
        }
    }

    #[test]
    fn links_out_lead_only_to_the_files_they_led_to_at_start() {
        for with_openat2 in [true, false] {
            let (top, mut dir) = layout(true, with_openat2);
            let (ds, out) = (top.path().join("ds"), top.path().join("out"));
            symlink(out.join("secret"), ds.join("linked")).unwrap();
            assert_eq!(read(dir.open_first(0, "linked", libc::O_RDONLY).unwrap()), "s");
            assert_eq!(dir.outside.len(), 1);
            std::fs::remove_file(ds.join("linked")).unwrap();
            symlink("../out/secret", ds.join("linked")).unwrap();
            assert_eq!(read(dir.open_file(0, "linked", libc::O_RDONLY).unwrap()), "s");
            std::fs::remove_file(ds.join("linked")).unwrap();
            symlink(out.join("sub/b"), ds.join("linked")).unwrap();
            let refused = dir.open_file(0, "linked", libc::O_RDONLY).unwrap_err();
            assert!(matches!(refused, BeneathError::Elsewhere { .. }), "{refused:?}");
            // Refused without --follow-links, as the walk leaves such a link out.
            let (_top, mut strict) = layout(false, with_openat2);
            symlink(out.join("secret"), strict.path().join("linked")).unwrap();
            assert!(matches!(strict.open_first(0, "linked", libc::O_RDONLY), Err(BeneathError::Outside { .. })));
        }
    }
}
