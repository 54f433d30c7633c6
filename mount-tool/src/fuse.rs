//! The FUSE adapter: translates fuser callbacks into calls on [`Fs`] and its results into replies. Every
//! errno comes from [`FsError::errno`]; every modifying operation is EROFS.
//!
//! Reads block the calling FUSE worker thread (there are `threads` of them) until the batch is
//! verified; all waits are bounded inside the prefetcher.
//!
//! **Passthrough.** Where the kernel offers FUSE passthrough and it is not turned off, an open of a file
//! waits until the file is verified and cached, then hands the kernel a sealed memory file holding it
//! (`open_backing`), so the reads and mmap faults of that handle never reach the daemon. The kernel
//! demands one backing file per inode at a time, and no mixing of passthrough and cached opens of one
//! inode; the handle table (`fs/handles.rs`) keeps that. The backing id lives until the inode's last
//! handle is released.
//!
//! **Readers.** FUSE reports the thread that made a request; the prefetcher is told its process
//! (`fs/handles.rs`'s `Owners`).

use crate::fs::handles::{Handles, Mode, Owners, Released};
use crate::fs::{Attr, Fs, FsError, Node};
use crate::stats::Stats;
use fuser::{BackingId, InitFlags, Notifier};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig, LockOwner,
    OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request,
};
use std::ffi::OsStr;
use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// How long the kernel may cache names and attributes: batch files never change.
const TTL: Duration = Duration::from_secs(3600);

/// A backing file registered with the kernel: the id lives until the inode's last handle is released
/// (the kernel resolves it after the open reply, so dropping it at once makes opens fail with EIO).
struct Backing {
    id: BackingId,
    _file: Arc<File>,
}

/// The fuser-facing filesystem.
pub struct FuseFs {
    fs: Fs,
    /// Try FUSE passthrough (the `passthrough` option); turned off when the kernel refuses.
    passthrough: AtomicBool,
    /// Tells the kernel to drop the page cache of files read through the daemon at their last close
    /// (`page_cache=drop`); set once the session exists.
    drop_page_cache: Option<Arc<OnceLock<Notifier>>>,
    opens: Mutex<Handles<Backing>>,
    owners: Owners,
}

impl FuseFs {
    /// `passthrough`: hand verified files to the kernel where it allows (see the module note).
    pub fn new(fs: Fs, passthrough: bool) -> Self {
        FuseFs {
            fs,
            passthrough: AtomicBool::new(passthrough),
            drop_page_cache: None,
            opens: Mutex::new(Handles::default()),
            owners: Owners::default(),
        }
    }

    /// Drops the kernel's page cache of each file read through the daemon when its last handle closes,
    /// through the session's notifier, which the caller sets in `notifier` once the session exists.
    pub fn drop_page_cache(mut self, notifier: Arc<OnceLock<Notifier>>) -> Self {
        self.drop_page_cache = Some(notifier);
        self
    }

    /// Opens `ino` for reading: in the mode the inode is already open in, else by passthrough when on.
    fn open_file(&self, req: &Request, ino: u64, reply: ReplyOpen) {
        let owner = self.owners.of(req.pid());
        let stats = self.fs.stats();
        {
            let mut opens = self.opens.lock().expect("opens");
            if let Some(mode) = opens.mode(ino) {
                if let Mode::Passthrough(_) = mode {
                    // The file's bytes are in the kernel already: a hit.
                    Stats::add(&stats.passthrough_opens, 1);
                    Stats::add(&stats.hits, 1);
                }
                return self.reply_open(req, &mut opens, ino, Mode::Daemon, reply);
            }
        }
        let mut mode = Mode::Daemon;
        if self.passthrough.load(Ordering::Relaxed) {
            // Waits for the file (bounded by `timeout`), holding no lock.
            let file = match self.fs.backing_file(ino, owner) {
                Ok(file) => file,
                Err(e) => {
                    tracing::warn!(ino, error = %e, "open failed");
                    return reply.error(errno(&e));
                }
            };
            // A large source file has no backing file: it reads through the daemon, chunk by chunk.
            if let Some(file) = file {
                match reply.open_backing(&*file) {
                    Ok(id) => mode = Mode::Passthrough(Backing { id, _file: file }),
                    Err(e) => {
                        tracing::warn!(error = %e, "the kernel refused a backing file: reads go through the daemon");
                        self.passthrough.store(false, Ordering::Relaxed);
                        self.fs.set_passthrough(false);
                    }
                }
            }
        }
        let mut opens = self.opens.lock().expect("opens");
        self.reply_open(req, &mut opens, ino, mode, reply);
    }

    /// Opens one more handle of `ino` for `owner` in the mode it is open in, or in `mode` if it is not
    /// open (another open may have finished meanwhile: its mode wins), and replies; the open got its file.
    fn reply_open(&self, req: &Request, opens: &mut Handles<Backing>, ino: u64, mode: Mode<Backing>, reply: ReplyOpen) {
        let owner = self.owners.of(req.pid());
        self.fs.opened_as(ino, owner, req.pid());
        match opens.open(ino, owner, mode) {
            (fh, Mode::Daemon) => {
                Stats::add(&self.fs.stats().daemon_opens, 1);
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE)
            }
            (fh, Mode::Passthrough(b)) => reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &b.id),
        }
    }

    fn file_attr(&self, a: &Attr) -> FileAttr {
        let o = &self.fs.options;
        let dir = a.node.is_dir();
        FileAttr {
            ino: INodeNo(a.node.ino()),
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

    fn ttl(node: Node) -> Duration {
        match node {
            // A name in rolling/ is a new file at each open (and each reader's layout): the kernel must look
            // it up every time. The indexed layout's twins are one file for every epoch.
            Node::Stats | Node::Rolling { .. } | Node::Shuffled { .. } => Duration::ZERO,
            _ => TTL,
        }
    }
}

fn errno(e: &FsError) -> Errno {
    Errno::from_i32(e.errno())
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // The largest readahead the kernel allows (it offers its bdi's), and a deep background queue:
        // readahead and async reads of many reader threads in flight at once.
        if let Err(max) = config.set_max_readahead(16 << 20) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(256);
        let _ = config.set_congestion_threshold(192);
        let on = self.passthrough.load(Ordering::Relaxed)
            && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            && config.set_max_stack_depth(1).is_ok();
        if self.passthrough.load(Ordering::Relaxed) && !on {
            tracing::info!("the kernel offers no FUSE passthrough: reads go through the daemon");
        }
        self.passthrough.store(on, Ordering::Relaxed);
        self.fs.set_passthrough(on);
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str() else { return reply.error(Errno::ENOENT) };
        match self.fs.lookup_as(parent.0, name, self.owners.of(req.pid()), req.pid()) {
            Ok(a) => reply.entry(&Self::ttl(a.node), &self.file_attr(&a), Generation(0)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(ino.0) {
            Ok(a) => reply.attr(&Self::ttl(a.node), &self.file_attr(&a)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let write = flags.0 & libc::O_ACCMODE != libc::O_RDONLY || flags.0 & libc::O_TRUNC != 0;
        match self.fs.open(ino.0, write) {
            Ok(Node::Stats) => {
                let fh = self.opens.lock().expect("opens").open_snapshot(self.fs.stats_json());
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO)
            }
            // Immutable data: keep the page cache across opens (mmap readers need the page cache too).
            Ok(_) => self.open_file(req, ino.0, reply),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let released = self.opens.lock().expect("opens").release(fh.0);
        let mut drop_pages = None;
        if let Some(Released { ino, owner, last }) = released {
            self.fs.released(ino, owner);
            if let Some(mode) = last {
                // Dropping the mode closes the backing id and lets the cache evict the batch.
                self.fs.closed(ino);
                if let (Mode::Daemon, Some(notifier)) = (mode, &self.drop_page_cache) {
                    drop_pages = notifier.get().map(|n| (n, ino));
                }
            }
        }
        reply.ok();
        // The last handle is closed and every mapping of the file is gone (a mapping holds its file
        // open), so no reader loses pages it is using; one that opens the file again reads it through the
        // daemon once more. Without this the page cache keeps every batch file of every epoch read, a
        // second copy of what the mount's cache holds, until the node runs short of memory.
        if let Some((notifier, ino)) = drop_pages {
            match notifier.inval_inode(INodeNo(ino), 0, 0) {
                Ok(()) => Stats::add(&self.fs.stats().page_cache_drops, 1),
                Err(e) => tracing::debug!(ino, error = %e, "cannot drop the page cache of a closed file"),
            }
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
        let snapshot = self.opens.lock().expect("opens").snapshot(fh.0);
        if let Some(json) = snapshot {
            let start = (offset as usize).min(json.len());
            let end = start.saturating_add(size as usize).min(json.len());
            return reply.data(&json[start..end]);
        }
        match self.fs.read(ino.0, offset, size, self.owners.of(req.pid())) {
            Ok(data) => reply.data(&data),
            Err(e) => {
                tracing::warn!(ino = ino.0, offset, size, error = %e, "read failed");
                reply.error(errno(&e))
            }
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn readdir(&self, req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let entries = match self.fs.dir_entries_from(ino.0, offset as usize, self.owners.of(req.pid())) {
            Ok(e) => e,
            Err(e) => return reply.error(errno(&e)),
        };
        for (i, (child, dir, name)) in entries.into_iter().enumerate() {
            let kind = if dir { FileType::Directory } else { FileType::RegularFile };
            if reply.add(INodeNo(child), offset + i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply.statfs(0, 0, 0, 0, 0, 1 << 20, 255, 1 << 20);
    }

    fn access(&self, _req: &Request, ino: INodeNo, mask: fuser::AccessFlags, reply: ReplyEmpty) {
        if mask.bits() & libc::W_OK != 0 {
            return reply.error(Errno::EROFS);
        }
        match self.fs.getattr(ino.0) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.error(Errno::EROFS);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _data: &[u8],
        _write_flags: fuser::WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        reply.error(Errno::EROFS);
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(Errno::EROFS);
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn mkdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, _mode: u32, _umask: u32, reply: ReplyEntry) {
        reply.error(Errno::EROFS);
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    fn link(&self, _req: &Request, _ino: INodeNo, _newparent: INodeNo, _newname: &OsStr, reply: ReplyEntry) {
        reply.error(Errno::EROFS);
    }
}
