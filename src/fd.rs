//! An open file's status flags, as both daemons set them, and advice on its pages.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Clears `O_NONBLOCK` from a regular file opened with it (so that a FIFO put in its place could not block
/// the open): its reads are then as a plain open's. io_uring answers reads of such a file that would wait
/// with `EAGAIN`, and the kernel serves a mount's passthrough reads from it.
pub fn clear_nonblock(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open for the calls' duration (`file` is borrowed); `F_GETFL` and `F_SETFL` only read
    // and set its status flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `posix_fadvise(2)` on `len` bytes of `file` from `offset` (`len` 0: to its end).
pub fn advise(file: &File, offset: u64, len: u64, advice: libc::c_int) -> io::Result<()> {
    // SAFETY: posix_fadvise reads no memory of ours; the descriptor is open for the call's duration
    // (borrowed from `file`).
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), offset as libc::off_t, len as libc::off_t, advice) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}
