//! When a connection last did something for its client, for `idle_timeout`: a request came, or bytes of
//! a response body went out. Bytes on the socket alone are not activity: HTTP/2's keep-alive PINGs, which
//! the client's stack answers by itself, moved some every `keep_alive_interval`, so `idle_timeout` never
//! closed an HTTP/2 connection, not even one whose client had stopped reading its bodies (each body then
//! held its place in `max_bodies_in_flight` for good). On an HTTP/2 connection (its client's first bytes
//! are the preface) the frames written are followed, and only DATA counts; on HTTP/1 every byte written is
//! a response's.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The last activity of one connection.
pub struct Activity {
    started: Instant,
    /// Milliseconds from `started`.
    last: AtomicU64,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity { started: Instant::now(), last: AtomicU64::new(0) })
    }

    pub fn touch(&self) {
        self.last.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// How long since the last activity (or the connection's start).
    pub fn idle(&self) -> Duration {
        self.started.elapsed().saturating_sub(Duration::from_millis(self.last.load(Ordering::Relaxed)))
    }
}

/// The HTTP/2 client preface's first bytes.
const PREFACE: &[u8] = b"PRI * HTTP/2.0";

/// A connection's IO, which touches its [`Activity`] as response bytes go out.
pub struct ActivityIo<I> {
    inner: I,
    activity: Arc<Activity>,
    /// The client's first bytes, until they say which HTTP it speaks.
    first: Vec<u8>,
    /// `None` until known; then whether the connection is HTTP/2, whose frames are followed.
    h2: Option<Frames>,
    http1: bool,
}

impl<I> ActivityIo<I> {
    pub fn new(inner: I, activity: Arc<Activity>) -> Self {
        ActivityIo { inner, activity, first: Vec::new(), h2: None, http1: false }
    }

    fn read(&mut self, bytes: &[u8]) {
        if self.h2.is_some() || self.http1 {
            return;
        }
        let want = PREFACE.len() - self.first.len();
        self.first.extend_from_slice(&bytes[..bytes.len().min(want)]);
        if !PREFACE.starts_with(&self.first) {
            self.http1 = true;
        } else if self.first.len() == PREFACE.len() {
            self.h2 = Some(Frames::default());
        }
    }

    /// `n` bytes of `bufs` were written.
    fn wrote<'a>(&mut self, bufs: impl Iterator<Item = &'a [u8]>, mut n: usize) {
        let mut data = self.http1;
        if let Some(frames) = &mut self.h2 {
            for buf in bufs {
                if n == 0 {
                    break;
                }
                let taken = &buf[..buf.len().min(n)];
                n -= taken.len();
                data |= frames.scan(taken);
            }
        }
        if data {
            self.activity.touch();
        }
    }
}

/// Where the server's HTTP/2 byte stream is: in a frame's 9-byte head, or in its payload.
#[derive(Default)]
struct Frames {
    head: [u8; 9],
    have: usize,
    /// Payload bytes of the current frame still to come.
    left: usize,
}

/// HTTP/2's DATA frame type.
const DATA: u8 = 0;

impl Frames {
    /// Follows `bytes` written; whether they hold any of a DATA frame (its head or payload).
    fn scan(&mut self, mut bytes: &[u8]) -> bool {
        let mut data = false;
        while !bytes.is_empty() {
            if self.left > 0 {
                let n = self.left.min(bytes.len());
                data |= self.head[3] == DATA;
                (self.left, bytes) = (self.left - n, &bytes[n..]);
                continue;
            }
            let n = (9 - self.have).min(bytes.len());
            self.head[self.have..self.have + n].copy_from_slice(&bytes[..n]);
            (self.have, bytes) = (self.have + n, &bytes[n..]);
            if self.have == 9 {
                self.have = 0;
                self.left =
                    usize::from(self.head[0]) << 16 | usize::from(self.head[1]) << 8 | usize::from(self.head[2]);
                data |= self.head[3] == DATA;
            }
        }
        data
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for ActivityIo<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            let this = &mut *self;
            this.read(&buf.filled()[before..]);
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for ActivityIo<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            self.wrote(std::iter::once(buf), n);
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            // No allocation a write: the slices as they are.
            self.wrote(bufs.iter().map(|b| &b[..]), n);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(kind: u8, len: usize) -> Vec<u8> {
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, 0, 0, 0, 0, 1];
        f.resize(9 + len, 0xAA);
        f
    }

    /// PINGs, SETTINGS, HEADERS and WINDOW_UPDATEs are not data; a DATA frame is, wherever the writes cut
    /// the stream (a head split over two writes, several frames in one).
    #[test]
    fn only_data_frames_are_activity() {
        let mut frames = Frames::default();
        let (ping, settings, headers) = (frame(6, 8), frame(4, 0), frame(1, 40));
        assert!(!frames.scan(&[ping.clone(), settings.clone(), headers.clone()].concat()));
        let data = frame(DATA, 100);
        assert!(!frames.scan(&data[..4]), "half a head says nothing yet");
        assert!(frames.scan(&data[4..20]));
        assert!(frames.scan(&data[20..]));
        assert!(!frames.scan(&ping));
        assert!(frames.scan(&[frame(8, 4), frame(DATA, 0)].concat()), "an empty DATA ends a stream");
    }

    proptest! {
        /// However the frames are cut into writes, a write is activity exactly where it holds a byte of a
        /// DATA frame's payload or the last of its head.
        #[test]
        fn writes_cut_anywhere_are_followed(
            kinds in proptest::collection::vec((0u8..10, 0usize..300), 1..20),
            cuts in proptest::collection::vec(1usize..400, 1..50),
        ) {
            let mut stream = Vec::new();
            let mut is_data = Vec::new();
            for (kind, len) in kinds {
                let f = frame(kind, len);
                // A head counts once whole: from its last byte.
                is_data.extend(std::iter::repeat_n(false, 8));
                is_data.extend(std::iter::repeat_n(kind == DATA, f.len() - 8));
                stream.extend(f);
            }
            let mut frames = Frames::default();
            let (mut at, mut cut) = (0, cuts.iter().cycle());
            while at < stream.len() {
                let end = (at + cut.next().unwrap()).min(stream.len());
                prop_assert_eq!(frames.scan(&stream[at..end]), is_data[at..end].iter().any(|&d| d));
                at = end;
            }
        }
    }

    /// A vectored write that took only part of its slices is followed to where it stopped: the PING it
    /// wrote is no activity, the DATA it wrote next is.
    #[test]
    fn a_partial_vectored_write_is_followed_to_where_it_stopped() {
        let activity = Activity::new();
        let mut io = ActivityIo::new((), activity.clone());
        io.read(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        std::thread::sleep(Duration::from_millis(20));
        let (ping, data) = (frame(6, 8), frame(DATA, 50));
        io.wrote([&ping[..], &data[..]].into_iter(), ping.len() + 8);
        assert_eq!(activity.last.load(Ordering::Relaxed), 0, "a PING and a DATA frame's first head bytes");
        io.wrote(std::iter::once(&data[8..]), 1);
        assert!(activity.last.load(Ordering::Relaxed) > 0, "the DATA frame's head whole");
    }

    /// Which HTTP the client speaks is read from its first bytes, however they come.
    #[test]
    fn the_preface_says_http2() {
        let activity = Activity::new();
        let mut io = ActivityIo::new((), activity.clone());
        io.read(b"PRI * HT");
        assert!(io.h2.is_none() && !io.http1);
        io.read(b"TP/2.0\r\n\r\nSM\r\n\r\n");
        assert!(io.h2.is_some() && !io.http1);
        let mut io = ActivityIo::new((), activity);
        io.read(b"GET / HTTP/1.1\r\n");
        assert!(io.http1 && io.h2.is_none());
    }
}
