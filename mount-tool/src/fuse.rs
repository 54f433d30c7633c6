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
use crate::ledger::{Ledger, Settings};
use crate::stats::Stats;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig, LockOwner,
    OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request,
};
use fuser::{InitFlags, Notifier};
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// How long the kernel may cache names and attributes: batch files never change.
const TTL: Duration = Duration::from_secs(3600);

/// The bit the kernel sets in the id of a request it re-sends (`FUSE_UNIQUE_RESEND`, Linux 6.9).
pub const RESENT: u64 = 1 << 63;

/// The fuser-facing filesystem.
pub struct FuseFs {
    fs: Fs,
    /// Try FUSE passthrough (the `passthrough` option); turned off when the kernel refuses.
    passthrough: AtomicBool,
    /// Tells the kernel to drop the page cache of files read through the daemon at their last close
    /// (`page_cache=drop`); set once the session exists.
    drop_page_cache: Option<Arc<OnceLock<Notifier>>>,
    opens: Mutex<Handles>,
    /// The memory files of inodes open by passthrough, held while they are (the cache keeps a held file).
    files: Mutex<HashMap<u64, Arc<File>>>,
    owners: Owners,
    /// The connection's `/dev/fuse` descriptor (set once the session exists): backing ids close on it.
    device: Arc<OnceLock<OwnedFd>>,
}

impl FuseFs {
    /// `passthrough`: hand verified files to the kernel where it allows (see the module note).
    pub fn new(fs: Fs, passthrough: bool) -> Self {
        FuseFs {
            fs,
            passthrough: AtomicBool::new(passthrough),
            drop_page_cache: None,
            opens: Mutex::new(Handles::default()),
            files: Mutex::new(HashMap::new()),
            owners: Owners::default(),
            device: Arc::new(OnceLock::new()),
        }
    }

    /// Drops the kernel's page cache of each file read through the daemon when its last handle closes,
    /// through the session's notifier, which the caller sets in `notifier` once the session exists.
    pub fn drop_page_cache(mut self, notifier: Arc<OnceLock<Notifier>>) -> Self {
        self.drop_page_cache = Some(notifier);
        self
    }

    /// Where the caller puts the connection's descriptor once the session exists (backing ids are closed
    /// on it).
    pub fn device(&self) -> Arc<OnceLock<OwnedFd>> {
        self.device.clone()
    }

    /// Serves a connection whose `INIT` an earlier process answered (`settings`), taking over from the
    /// worker before this one what `ledger` holds: every open handle with its mode and backing id, the
    /// views' state, and the backing ids it left registered and unrecorded (closed now). `device` is the
    /// connection's descriptor.
    pub fn take_over(mut self, ledger: Arc<Ledger>, settings: Settings, device: OwnedFd) -> Self {
        self.passthrough.store(settings.passthrough, Ordering::Relaxed);
        self.fs.set_passthrough(settings.passthrough);
        self.fs.record_in(ledger.clone());
        let (handles, closing) = Handles::restore(ledger.clone(), || self.fs.stats_json());
        let files = handles.files();
        for &(_, ino, owner) in &files {
            self.fs.adopted(ino, owner);
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
            if !live.contains(&id) && crate::sys::close_backing(device.as_fd(), id).is_ok() {
                closed += 1;
            }
        }
        if ledger.counters().restarts > 0 || !files.is_empty() {
            tracing::info!(handles = files.len(), passthrough = live.len(), closed, "took over the open handles");
        }
        *self.opens.get_mut().expect("opens") = handles;
        let _ = self.device.set(device);
        self
    }

    /// Closes backing id `id` on the connection.
    fn close_backing(&self, id: u32) {
        if let Some(device) = self.device.get() {
            if let Err(e) = crate::sys::close_backing(device.as_fd(), id) {
                tracing::debug!(id, error = %e, "cannot close a backing id");
            }
        }
    }

    /// Opens `ino` for reading: in the mode the inode is already open in, else by passthrough when on. An
    /// open the kernel re-sends (its last worker died before answering it) gets the handle recorded for it.
    fn open_file(&self, req: &Request, ino: u64, reply: ReplyOpen) {
        let owner = self.owners.of(req.pid());
        let stats = self.fs.stats();
        let unique = req.unique().0;
        {
            let mut opens = self.opens.lock().expect("opens");
            if unique & RESENT != 0 {
                if let Some((fh, mode)) = opens.resent(unique & !RESENT) {
                    return reply_open(fh, mode.unwrap_or(Mode::Daemon), reply);
                }
            }
            if let Some(mode) = opens.mode(ino) {
                if let Mode::Passthrough(_) = mode {
                    // The file's bytes are in the kernel already: a hit.
                    Stats::add(&stats.passthrough_opens, 1);
                    Stats::add(&stats.hits, 1);
                }
                self.open_as(req, &mut opens, ino, Mode::Daemon, reply);
                return;
            }
        }
        let mut mode = Mode::Daemon;
        let mut made = None;
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
                    Ok(id) => {
                        let id = id.into_raw();
                        if let Some(ledger) = self.opens.lock().expect("opens").ledger() {
                            ledger.backing_registered(id);
                        }
                        mode = Mode::Passthrough(id);
                        made = Some((id, file));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the kernel refused a backing file: reads go through the daemon");
                        self.passthrough.store(false, Ordering::Relaxed);
                        self.fs.set_passthrough(false);
                    }
                }
            }
        }
        let mut opens = self.opens.lock().expect("opens");
        let got = self.open_as(req, &mut opens, ino, mode, reply);
        if let Some((id, file)) = made {
            if got == Mode::Passthrough(id) {
                self.files.lock().expect("files").insert(ino, file);
            } else {
                // Another open of the inode finished first: its mode stands, this backing id goes.
                self.close_backing(id);
            }
        }
    }

    /// Opens one more handle of `ino` for `owner` in the mode it is open in, or in `mode` if it is not
    /// open (another open may have finished meanwhile: its mode wins), and replies; the open got its file.
    fn open_as(&self, req: &Request, opens: &mut Handles, ino: u64, mode: Mode, reply: ReplyOpen) -> Mode {
        let owner = self.owners.of(req.pid());
        self.fs.opened_as(ino, owner, req.pid());
        let (fh, mode) = opens.open(ino, owner, mode, req.unique().0 & !RESENT);
        if mode == Mode::Daemon {
            Stats::add(&self.fs.stats().daemon_opens, 1);
        }
        reply_open(fh, mode, reply);
        mode
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

/// Backing ids on each side of the largest recorded that a takeover closes unless a handle uses them.
const SWEPT: u32 = 256;

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
    let _ = config.set_congestion_threshold(192);
    let on = passthrough
        && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
        && config.set_max_stack_depth(1).is_ok();
    if passthrough && !on {
        tracing::info!("the kernel offers no FUSE passthrough: reads go through the daemon");
    }
    on
}

fn errno(e: &FsError) -> Errno {
    Errno::from_i32(e.errno())
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let on = negotiate(config, self.passthrough.load(Ordering::Relaxed));
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
                let unique = req.unique().0;
                let mut opens = self.opens.lock().expect("opens");
                // Re-sent after a takeover: the handle the last worker recorded for it (a fresh snapshot).
                let resent = (unique & RESENT != 0).then(|| opens.resent(unique & !RESENT)).flatten();
                let fh = match resent {
                    Some((fh, _)) => fh,
                    None => opens.open_snapshot(self.fs.stats_json(), unique & !RESENT),
                };
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_NOFLUSH)
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
                // The backing id closes, and the cache may evict the batch.
                if let Mode::Passthrough(id) = mode {
                    self.close_backing(id);
                    self.files.lock().expect("files").remove(&ino);
                    self.opens.lock().expect("opens").closed(fh.0);
                }
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
