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
