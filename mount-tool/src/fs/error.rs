//! The filesystem's errors, one errno each at the FUSE edge.

use crate::prefetch::ReadError;
use thiserror::Error;

/// A filesystem error; the FUSE edge maps each variant to one errno.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("not a directory")]
    NotADirectory,
    #[error("is a directory")]
    IsADirectory,
    #[error("read-only filesystem")]
    ReadOnly,
    /// An inode number an earlier worker handed out that this one cannot name again (`raw/`'s, numbered
    /// past what the ledger's journal kept): a lookup by path names the file anew.
    #[error("an inode numbered by an earlier worker of this mount, beyond what its ledger kept: look it up again")]
    Stale,
    #[error("{0}")]
    Io(ReadError),
}

impl FsError {
    /// The errno returned to the caller.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::NotADirectory => libc::ENOTDIR,
            FsError::IsADirectory => libc::EISDIR,
            FsError::ReadOnly => libc::EROFS,
            FsError::Stale => libc::ESTALE,
            FsError::Io(_) => libc::EIO,
        }
    }
}

impl From<ReadError> for FsError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::NotFound(_) => FsError::NotFound,
            e => FsError::Io(e),
        }
    }
}
