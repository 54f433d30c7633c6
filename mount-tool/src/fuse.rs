//! The FUSE adapter: translates fuser callbacks into calls on [`Fs`] and its [`OpenFiles`], and their
//! results into replies; [`Connection`] is what the open files ask of the kernel, done on the mount's FUSE
//! connection. Every error reaches the kernel through `FuseFs::fail`: its errno, logged, counted. Every
//! modifying operation is EROFS.
//!
//! Requests that may wait (lookups, attributes, listings, opens, reads through the daemon) block the FUSE
//! worker thread that took them (there are `threads` of them) until the batch is verified, while fewer than
//! `threads - 1` are so blocked, and a helper thread beyond that (`fuse/waits.rs`): the last FUSE thread is
//! always free. All waits are bounded inside the prefetcher.
//!
//! **Readers.** FUSE reports the thread that made a request; the prefetcher is told its process
//! ([`OpenFiles::owner`]).

use crate::fs::handles::Mode;
use crate::fs::open_files::{Kernel, OpenFiles};
use crate::fs::{Attr, Fs, FsError, Keep, Opening};
use crate::ledger::{Ledger, Settings};
use crate::stats::Stats;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig, LockOwner,
    OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, ReplyWrite, Request,
};
use fuser::{InitFlags, Notifier};
use std::ffi::OsStr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

mod waits;
use waits::Waits;

/// How long the kernel may cache names and attributes: batch files never change.
const TTL: Duration = Duration::from_secs(3600);

/// The mount's FUSE connection, as the open files use it: its `/dev/fuse` descriptor (backing ids open
/// and close on it) and its notifier (page cache dropped), each set once the session exists.
#[derive(Default)]
pub struct Connection {
    pub device: OnceLock<OwnedFd>,
    pub notifier: OnceLock<Notifier>,
}

impl Connection {
    fn device(&self) -> std::io::Result<std::os::fd::BorrowedFd<'_>> {
        self.device.get().map(|d| d.as_fd()).ok_or_else(|| std::io::Error::other("no FUSE connection yet"))
    }
}

impl Kernel for Connection {
    fn open_backing(&self, file: &std::fs::File) -> std::io::Result<u32> {
        crate::sys::open_backing(self.device()?, file.as_fd())
    }

    fn close_backing(&self, id: u32) -> std::io::Result<()> {
        crate::sys::close_backing(self.device()?, id)
    }

    fn drop_pages(&self, ino: u64) -> std::io::Result<()> {
        let notifier = self.notifier.get().ok_or_else(|| std::io::Error::other("no notifier yet"))?;
        notifier.inval_inode(INodeNo(ino), 0, 0)
    }
}

/// The fuser-facing filesystem: what it serves, and where requests that may wait run (`fuse/waits.rs`).
pub struct FuseFs {
    served: Arc<Served>,
    waits: Waits,
}

/// What the FUSE threads and the helpers serve requests from.
struct Served {
    fs: Fs,
    opens: OpenFiles,
    connection: Arc<Connection>,
}

impl FuseFs {
    /// `passthrough`: hand verified files to the kernel where it allows; `drop_page_cache`: drop the
    /// kernel's page cache of each file read through the daemon when its last handle closes
    /// (`page_cache=drop`); `threads`: the session's FUSE threads.
    pub fn new(fs: Fs, passthrough: bool, drop_page_cache: bool, threads: usize) -> Self {
        let connection = Arc::new(Connection::default());
        let opens = OpenFiles::new(connection.clone(), passthrough, drop_page_cache);
        FuseFs { served: Arc::new(Served { fs, opens, connection }), waits: Waits::new(threads) }
    }

    /// Where the caller puts the connection's descriptor and notifier once the session exists.
    pub fn connection(&self) -> Arc<Connection> {
        self.served.connection.clone()
    }

    /// Serves a connection whose `INIT` an earlier process answered (`settings`), taking over from the
    /// worker before this one what `ledger` holds ([`OpenFiles::take_over`]). `device` is the
    /// connection's descriptor.
    pub fn take_over(mut self, ledger: Arc<Ledger>, settings: Settings, device: OwnedFd) -> Self {
        let served = Arc::get_mut(&mut self.served).expect("no request is served before the takeover");
        let _ = served.connection.device.set(device);
        served.opens.take_over(&mut served.fs, ledger, settings);
        self
    }
}

impl Served {
    /// The errno `e` answers request `op` of `ino` with, logged (a failed read or open as a warning: a
    /// reader gets EIO) and counted (`errors`: requests answered EIO).
    fn fail(&self, op: &'static str, ino: u64, e: &FsError) -> Errno {
        match e {
            FsError::Io(_) => {
                tracing::warn!(op, ino, error = %e, "answered EIO");
                Stats::add(&self.fs.stats().errors, 1);
            }
            _ => tracing::trace!(op, ino, error = %e, "refused"),
        }
        Errno::from_i32(e.errno())
    }

    fn file_attr(&self, a: &Attr) -> FileAttr {
        let o = &self.fs.options;
        let dir = a.dir;
        FileAttr {
            ino: INodeNo(a.ino),
            size: a.size,
            blocks: a.size.div_ceil(512),
            atime: o.time,
            mtime: o.time,
            ctime: o.time,
            crtime: o.time,
            kind: if dir { FileType::Directory } else { FileType::RegularFile },
            perm: if dir { 0o555 } else { 0o444 },
            nlink: if dir { 2 } else { 1 },
            uid: o.uid,
            gid: o.gid,
            rdev: 0,
            // Large blocks invite large reads (stdio and cp size their buffers by st_blksize).
            blksize: 1 << 20,
            flags: 0,
        }
    }

    /// Lists directory `ino` from position `offset` on, as process `pid` sees it: each entry (its
    /// inode, the position after it, its type and name) handed to `add`, until `add` says the reply is
    /// full; or the errno answered to `op`.
    fn list(
        &self,
        op: &'static str,
        pid: u32,
        ino: INodeNo,
        offset: u64,
        mut add: impl FnMut(u64, u64, FileType, String) -> bool,
    ) -> Result<(), Errno> {
        let owner = self.opens.owner(pid);
        let entries = self.fs.dir_entries_from(ino.0, offset as usize, owner).map_err(|e| self.fail(op, ino.0, &e))?;
        for (i, (child, dir, name)) in entries.into_iter().enumerate() {
            let kind = if dir { FileType::Directory } else { FileType::RegularFile };
            if add(child, offset + i as u64 + 1, kind, name) {
                break;
            }
        }
        Ok(())
    }

    /// How long the kernel may keep the name that led to a node. A name in rolling/ is a new file at each
    /// open (and each reader's layout), and a name in shuffled/ a new sample at each lookup: the kernel
    /// must look it up every time.
    fn entry_ttl(keep: Keep) -> Duration {
        match keep {
            Keep::All => TTL,
            Keep::Attributes | Keep::Nothing => Duration::ZERO,
        }
    }

    /// How long the kernel may keep a node's attributes: for ever but the stats' (a snapshot each open),
    /// since every other inode names contents that never change (a sample of `shuffled/` in one epoch,
    /// `rolling/`'s file of one epoch), so the `fstat` after an open is not a round trip.
    fn attr_ttl(keep: Keep) -> Duration {
        match keep {
            Keep::All | Keep::Attributes => TTL,
            Keep::Nothing => Duration::ZERO,
        }
    }
}

/// Replies to an open with handle `fh` reading in `mode`. No file of a read-only mount has anything to
/// flush: the kernel sends no FLUSH at each close (`FOPEN_NOFLUSH`), so a close never waits on the daemon
/// (nor, while a worker is being replaced, on the next one).
fn reply_open(fh: u64, mode: Mode, reply: ReplyOpen) {
    match mode {
        Mode::Daemon => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_NOFLUSH),
        Mode::Passthrough(id) => {
            // SAFETY: `id` is open on this connection (the handle table holds it) and is not closed here:
            // `into_raw` takes it back from the wrapper.
            let backing = unsafe { reply.wrap_backing(id) };
            reply.opened_passthrough(FileHandle(fh), FopenFlags::FOPEN_NOFLUSH, &backing);
            let _ = backing.into_raw();
        }
    }
}

/// What `INIT` settles, for a mount that wants `passthrough`: the largest readahead, a deep background
/// queue, and passthrough where the kernel offers it (returned). The supervisor's negotiation and an
/// unsupervised mount's share it.
pub fn negotiate(config: &mut KernelConfig, passthrough: bool) -> bool {
    // The largest readahead the kernel allows (it offers its bdi's), and a deep background queue:
    // readahead and async reads of many reader threads in flight at once.
    if let Err(max) = config.set_max_readahead(16 << 20) {
        let _ = config.set_max_readahead(max);
    }
    let _ = config.set_max_background(256);
    // Nothing is written to a read-only mount: 1 MiB (not fuser's 16 MiB) sizes each FUSE ring entry's
    // buffer to the largest read instead (`fuse_uring`).
    let _ = config.set_max_write(1 << 20);
    // Listings carry each name's entry (`readdirplus`), every part of them (not only the first, as
    // `FUSE_READDIRPLUS_AUTO` would): a walk's files then open with no lookup each.
    let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS);
    let _ = config.set_congestion_threshold(192);
    let on = passthrough
        && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
        && config.set_max_stack_depth(1).is_ok();
    if passthrough && !on {
        tracing::info!("the kernel offers no FUSE passthrough: reads go through the daemon");
    }
    on
}

/// Callbacks that would change the filesystem, each answering EROFS: its name, the types of its arguments
/// after the request, and its reply. (The mount is read-only, so the kernel refuses most of them itself.)
macro_rules! read_only {
    ($($name:ident($($arg:ty),*) -> $reply:ty;)*) => {
        $(
            fn $name(&self, _req: &Request, $(_: $arg,)* reply: $reply) {
                reply.error(Errno::EROFS);
            }
        )*
    };
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let on = negotiate(config, self.served.opens.passthrough());
        self.served.opens.settle(&self.served.fs, on);
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str().map(str::to_owned) else { return reply.error(Errno::ENOENT) };
        let (s, pid) = (self.served.clone(), req.pid());
        self.waits.run(move || s.lookup(pid, parent, &name, reply));
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let s = self.served.clone();
        self.waits.run(move || s.getattr(ino, reply));
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if fuser::served_by_ring() {
            crate::stats::Stats::add(&self.served.fs.stats().ring_opens, 1);
        }
        let (s, pid, unique) = (self.served.clone(), req.pid(), req.unique().0);
        self.waits.run(move || s.open(pid, unique, ino, flags, reply));
    }

    fn release(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let s = &self.served;
        let closed = s.opens.release_of(&s.fs, fh.0, req.unique().0);
        reply.ok();
        // Answered first: the kernel drops the pages of a file no handle holds. Queued for a thread of its
        // own: the invalidation may wait on READs that only a FUSE thread, this one, can answer.
        if let Some(ino) = closed {
            s.opens.drop_pages(&s.fs, ino);
        }
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if let Some(json) = self.served.opens.snapshot(fh.0) {
            let start = (offset as usize).min(json.len());
            let end = start.saturating_add(size as usize).min(json.len());
            return reply.data(&json[start..end]);
        }
        let (s, pid) = (self.served.clone(), req.pid());
        self.waits.run(move || s.read(pid, ino, offset, size, reply));
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn readdir(&self, req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, reply: ReplyDirectory) {
        let (s, pid) = (self.served.clone(), req.pid());
        self.waits.run(move || s.readdir(pid, ino, offset, reply));
    }

    fn readdirplus(&self, req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, reply: ReplyDirectoryPlus) {
        let (s, pid) = (self.served.clone(), req.pid());
        self.waits.run(move || s.readdirplus(pid, ino, offset, reply));
    }

    /// No file here is a terminal or takes any ioctl: ENOTTY, what a local file answers, at once. Python's
    /// `open()` asks every file it opens whether it is a terminal (`TCGETS`), and Linux sends FUSE each
    /// one (it keeps no answer as it does for xattrs): a round trip per file, logged as unimplemented
    /// by fuser's default before.
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }

    /// No extended attributes: ENOSYS, after which Linux answers every xattr call of the mount itself
    /// (`EOPNOTSUPP`), so `ls -l`'s first question is the only one, and not a warning in the log.
    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOSYS);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOSYS);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply.statfs(0, 0, 0, 0, 0, 1 << 20, 255, 1 << 20);
    }

    fn access(&self, _req: &Request, ino: INodeNo, mask: fuser::AccessFlags, reply: ReplyEmpty) {
        if mask.bits() & libc::W_OK != 0 {
            return reply.error(Errno::EROFS);
        }
        let s = self.served.clone();
        self.waits.run(move || match s.fs.getattr(ino.0) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(s.fail("access", ino.0, &e)),
        });
    }

    read_only! {
        setattr(INodeNo, Option<u32>, Option<u32>, Option<u32>, Option<u64>, Option<fuser::TimeOrNow>,
            Option<fuser::TimeOrNow>, Option<std::time::SystemTime>, Option<FileHandle>, Option<std::time::SystemTime>,
            Option<std::time::SystemTime>, Option<std::time::SystemTime>, Option<fuser::BsdFileFlags>) -> ReplyAttr;
        write(INodeNo, FileHandle, u64, &[u8], fuser::WriteFlags, OpenFlags, Option<LockOwner>) -> ReplyWrite;
        create(INodeNo, &OsStr, u32, u32, i32) -> ReplyCreate;
        mknod(INodeNo, &OsStr, u32, u32, u32) -> ReplyEntry;
        mkdir(INodeNo, &OsStr, u32, u32) -> ReplyEntry;
        unlink(INodeNo, &OsStr) -> ReplyEmpty;
        rmdir(INodeNo, &OsStr) -> ReplyEmpty;
        symlink(INodeNo, &OsStr, &std::path::Path) -> ReplyEntry;
        rename(INodeNo, &OsStr, INodeNo, &OsStr, fuser::RenameFlags) -> ReplyEmpty;
        link(INodeNo, INodeNo, &OsStr) -> ReplyEntry;
    }
}

/// The handlers of requests that may wait, run by [`Waits`] on a FUSE thread or a helper.
impl Served {
    fn lookup(&self, pid: u32, parent: INodeNo, name: &str, reply: ReplyEntry) {
        match self.fs.lookup_as(parent.0, name, self.opens.owner(pid), pid) {
            // fuser's order: the attributes' TTL, then the name's.
            Ok(a) => reply.entry_with_ttls(
                &Self::attr_ttl(a.keep),
                &Self::entry_ttl(a.keep),
                &self.file_attr(&a),
                Generation(0),
            ),
            Err(e) => reply.error(self.fail("lookup", parent.0, &e)),
        }
    }

    fn getattr(&self, ino: INodeNo, reply: ReplyAttr) {
        match self.fs.getattr(ino.0) {
            Ok(a) => reply.attr(&Self::attr_ttl(a.keep), &self.file_attr(&a)),
            Err(e) => reply.error(self.fail("getattr", ino.0, &e)),
        }
    }

    fn open(&self, pid: u32, unique: u64, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let write = flags.0 & libc::O_ACCMODE != libc::O_RDONLY || flags.0 & libc::O_TRUNC != 0;
        match self.fs.open(ino.0, write) {
            Ok(Opening::Snapshot) => {
                let fh = self.opens.open_stats(&self.fs, unique);
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_NOFLUSH)
            }
            Ok(Opening::File) => match self.opens.open(&self.fs, ino.0, pid, unique) {
                Ok((fh, mode)) => reply_open(fh, mode, reply),
                Err(e) => reply.error(self.fail("open", ino.0, &e)),
            },
            Err(e) => reply.error(self.fail("open", ino.0, &e)),
        }
    }

    fn read(&self, pid: u32, ino: INodeNo, offset: u64, size: u32, reply: ReplyData) {
        match self.fs.read_as(ino.0, offset, size, self.opens.owner(pid), pid) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(self.fail("read", ino.0, &e)),
        }
    }

    fn readdir(&self, pid: u32, ino: INodeNo, offset: u64, mut reply: ReplyDirectory) {
        match self
            .list("readdir", pid, ino, offset, |child, next, kind, name| reply.add(INodeNo(child), next, kind, name))
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    /// A listing with each name's entry and attributes (`READDIRPLUS`): a walk that lists a folder and
    /// then opens its files (ImageFolder's, DALI's over an epoch folder) costs no lookup per file. A
    /// name looked up anew at every use (`shuffled/`'s, `rolling/`'s, the stats'), or whose attributes
    /// cost work (the indexed layout's twins), is listed alone and looked up when used.
    fn readdirplus(&self, pid: u32, ino: INodeNo, offset: u64, mut reply: ReplyDirectoryPlus) {
        let listed =
            self.list("readdirplus", pid, ino, offset, |child, next, kind, name| match self.fs.listed_attr(child) {
                Some(a) => reply.add(INodeNo(child), next, &name, &TTL, &self.file_attr(&a), Generation(0)),
                None => reply.add_name(INodeNo(child), next, &name, kind),
            });
        match listed {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which nodes keep what is the views' to say (`fs.rs`'s tests); this is what each means to the kernel.
    #[test]
    fn names_handed_out_anew_are_looked_up_each_time_and_their_inodes_attributes_are_kept() {
        let ttls = |keep| (Served::entry_ttl(keep), Served::attr_ttl(keep));
        assert_eq!(ttls(Keep::Attributes), (Duration::ZERO, TTL));
        assert_eq!(ttls(Keep::Nothing), (Duration::ZERO, Duration::ZERO));
        assert_eq!(ttls(Keep::All), (TTL, TTL));
    }
}
