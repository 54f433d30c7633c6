//! Body bytes sent from their file: an h2c connection's socket, whose vectored writes send each slice
//! of a mapped shard with `sendfile(2)` rather than copying it out of the mapping.
//!
//! hyper's HTTP/2 writes a DATA frame as one `writev` of its 9-byte header (with any small frames
//! before it) and its payload, a slice of the mapped shard (`body.rs`). The copy of that payload into
//! the socket was 42 % of the server's CPU. Here a vectored write finds its first slice that lies in a
//! file mapping ([`batchfs::mmap::source_of`]): the slices before it go out with `MSG_MORE` (so the
//! header waits for its payload in the same segment), and the slice itself with `sendfile` from the
//! file at the slice's offset, which hands the socket the file's pages (the mapping's own) instead of
//! copies. Writes of anything else, and over TLS (where rustls must encrypt the bytes), are plain.
//!
//! Each call writes at most one of the two parts and returns how much it wrote, as a vectored write
//! may; the caller advances and calls again. A shard cut short under the server makes `sendfile` come
//! back short of the slice: the connection then fails (the client retries elsewhere and its checksum
//! never sees a missing byte).

use crate::metrics::Metrics;
use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// Slices shorter than this are copied: `sendfile` costs a page reference per page and a system call
/// of its own, more than copying a few pages.
pub const SENDFILE_MIN: usize = 16 << 10;

/// A TCP connection that sends slices of mapped files from the file.
pub struct FileSendStream {
    stream: TcpStream,
    /// Counts the bytes sent from files (`sendfile_bytes`).
    metrics: Arc<Metrics>,
}

impl FileSendStream {
    pub fn new(stream: TcpStream, metrics: Arc<Metrics>) -> Self {
        FileSendStream { stream, metrics }
    }

    /// Runs `op` on the socket once it is writable, again after each `WouldBlock`.
    fn poll_send(&self, cx: &mut Context<'_>, mut op: impl FnMut(i32) -> io::Result<usize>) -> Poll<io::Result<usize>> {
        let fd = self.stream.as_raw_fd();
        loop {
            ready!(self.stream.poll_write_ready(cx))?;
            match self.stream.try_io(Interest::WRITABLE, || op(fd)) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                other => return Poll::Ready(other),
            }
        }
    }
}

/// `sendmsg(2)` of `bufs` with `MSG_MORE`: more follows at once, so a partial segment is held for it.
fn send_more(fd: i32, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: a zeroed msghdr is valid (no name, no control); `IoSlice` has `iovec`'s layout on Unix,
    // and the slices outlive the call.
    let n = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = bufs.len().min(libc::UIO_MAXIOV as usize) as _;
        libc::sendmsg(fd, &msg, libc::MSG_MORE | libc::MSG_NOSIGNAL)
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// `sendfile(2)` of `len` bytes of `file` from `offset`; a file that ends first is an error.
fn send_file(fd: i32, file: &std::fs::File, offset: u64, len: usize) -> io::Result<usize> {
    let mut at = offset as libc::off_t;
    // SAFETY: both descriptors are open for the call (the file is held by the caller), `at` is a valid
    // offset to update.
    let n = unsafe { libc::sendfile(fd, file.as_raw_fd(), &mut at, len) };
    match n {
        n if n < 0 => Err(io::Error::last_os_error()),
        0 => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "a mapped shard ended before the bytes sent from it")),
        n => Ok(n as usize),
    }
}

impl AsyncRead for FileSendStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for FileSendStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let sourced = bufs
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= SENDFILE_MIN)
            .find_map(|(i, b)| batchfs::mmap::source_of(b).map(|source| (i, source)));
        match sourced {
            None => Pin::new(&mut self.stream).poll_write_vectored(cx, bufs),
            Some((0, (file, offset))) => {
                let sent = ready!(self.poll_send(cx, |fd| send_file(fd, &file, offset, bufs[0].len())))?;
                self.metrics.sendfile_bytes.fetch_add(sent as u64, Ordering::Relaxed);
                Poll::Ready(Ok(sent))
            }
            Some((i, _)) => self.poll_send(cx, |fd| send_more(fd, &bufs[..i])),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
