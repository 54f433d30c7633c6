//! The FUSE adapter: translates fuser callbacks into calls on [`Fs`] and its results into replies. Every
//! errno comes from [`FsError::errno`]; every modifying operation is EROFS.
//!
//! Reads block the calling FUSE worker thread (there are `threads` of them) until the batch is
//! verified; all waits are bounded inside the prefetcher.

use crate::fs::{Attr, Fs, FsError, Node};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig, LockOwner,
    OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request,
};
use std::ffi::OsStr;
use std::time::Duration;

/// How long the kernel may cache names and attributes: batch files never change.
const TTL: Duration = Duration::from_secs(3600);

/// The fuser-facing filesystem.
pub struct FuseFs {
    fs: Fs,
}

impl FuseFs {
    pub fn new(fs: Fs) -> Self {
        FuseFs { fs }
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
        if node == Node::Stats {
            Duration::ZERO
        } else {
            TTL
        }
    }
}

fn errno(e: &FsError) -> Errno {
    Errno::from_i32(e.errno())
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_readahead(1 << 20);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str() else { return reply.error(Errno::ENOENT) };
        match self.fs.lookup(parent.0, name) {
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

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let write = flags.0 & libc::O_ACCMODE != libc::O_RDONLY || flags.0 & libc::O_TRUNC != 0;
        match self.fs.open(ino.0, write) {
            Ok(Node::Stats) => reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO),
            // Immutable data: keep the page cache across opens (mmap readers need the page cache too).
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.fs.read(ino.0, offset, size, req.pid()) {
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

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let entries = match self.fs.readdir(ino.0) {
            Ok(e) => e,
            Err(e) => return reply.error(errno(&e)),
        };
        let parent = match Node::from_ino(ino.0) {
            Some(Node::Epoch(_)) | Some(Node::MetaDir) => crate::fs::ROOT,
            _ => ino.0,
        };
        let all = [(ino.0, FileType::Directory, ".".to_owned()), (parent, FileType::Directory, "..".to_owned())]
            .into_iter()
            .chain(entries.into_iter().map(|(n, name)| {
                (n.ino(), if n.is_dir() { FileType::Directory } else { FileType::RegularFile }, name)
            }));
        for (i, (child, kind, name)) in all.enumerate().skip(offset as usize) {
            if reply.add(INodeNo(child), i as u64 + 1, kind, name) {
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
