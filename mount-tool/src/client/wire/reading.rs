//! A connection's reading side: [`Reading`], the task that reads the server's frames into their streams'
//! sinks (see `client/wire.rs`), and [`Buffered`], the socket read in small pieces for what is small.

use super::{Got, Out, Reply, Shared, Slot, Target, CONNECTION_WINDOW, CONTROL_QUEUED, ERROR_BODY, STREAM_WINDOW};
use crate::client::{Body, ClientError, Sink};
use batchfs::api;
use batchfs::frames::{self, code, setting, Event, FrameError, FrameReader, Next};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{mpsc, Semaphore};

/// The reader's state: see [`Reading::run`].
pub(super) struct Reading {
    shared: Arc<Shared>,
    out: mpsc::UnboundedSender<Out>,
    reader: FrameReader,
    /// What the server may still send on the connection.
    window: u32,
    /// Bytes taken and not yet given back to the connection's window.
    unacked: u32,
    /// HPACK's state for the server's heads.
    decoder: batchfs::hpack::Decoder,
    /// The streams the server takes at once, as last announced.
    streams_allowed: usize,
}

/// Why reading stopped.
enum Stop {
    Io(std::io::Error),
    Protocol(FrameError),
}

impl Reading {
    pub(super) fn new(shared: Arc<Shared>, out: mpsc::UnboundedSender<Out>, reader: FrameReader) -> Self {
        Reading {
            shared,
            out,
            reader,
            decoder: batchfs::hpack::Decoder::default(),
            window: CONNECTION_WINDOW,
            unacked: 0,
            streams_allowed: super::INITIAL_STREAMS,
        }
    }

    pub(super) async fn run<R: AsyncRead + Unpin>(mut self, mut read: Buffered<R>) {
        let why = match self.frames(&mut read).await {
            Stop::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                self.shared.error("the server closed the connection")
            }
            Stop::Io(e) => ClientError::unreachable(self.shared.server.clone(), e),
            Stop::Protocol(e) => {
                tracing::warn!(server = %self.shared.server, error = %e, "closing a connection that broke HTTP/2");
                let _ = self.out.send(Out::Frame(frames::goaway(0, e.code)));
                ClientError::Malformed { server: self.shared.server.clone(), message: e.to_string() }
            }
        };
        self.shared.end(&why);
    }

    async fn frames<R: AsyncRead + Unpin>(&mut self, read: &mut Buffered<R>) -> Stop {
        let mut small = vec![0u8; self.reader.max_frame() as usize];
        // The last frame was DATA of at least the inbox's size: the next is likely one too.
        let mut in_a_body = false;
        loop {
            let event = match self.reader.next() {
                Next::Head => {
                    let mut head = [0u8; frames::HEADER_LEN];
                    // Inside a body, the head alone: the inbox would take the next frame's first bytes,
                    // to be copied again into their sink (4 % of the daemon's CPU), for the same number
                    // of `recv`s (a head, then the rest of the frame straight into its sink).
                    read.alone = in_a_body;
                    let got = read.read_exact(&mut head).await;
                    read.alone = false;
                    if let Err(e) = got {
                        return Stop::Io(e);
                    }
                    self.reader.feed(&head)
                }
                Next::Payload(n) => {
                    if let Err(e) = read.read_exact(&mut small[..n]).await {
                        return Stop::Io(e);
                    }
                    self.reader.feed(&small[..n])
                }
                Next::Skip(n) => {
                    if let Err(e) = read.read_exact(&mut small[..n]).await {
                        return Stop::Io(e);
                    }
                    Ok(self.reader.skipped())
                }
                Next::Data { stream, len } => {
                    in_a_body = len >= read.buf.len();
                    if let Err(e) = self.data(read, stream, len, &mut small).await {
                        return Stop::Io(e);
                    }
                    Ok(self.reader.data_read())
                }
            };
            self.shared.heard();
            let handled = match event {
                Ok(Some(event)) => self.event(event),
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = handled {
                return Stop::Protocol(e);
            }
        }
    }

    /// `len` bytes of `stream`'s body: into its sink if it wants them, else dropped.
    async fn data<R: AsyncRead + Unpin>(
        &mut self,
        read: &mut R,
        stream: u32,
        len: usize,
        scratch: &mut [u8],
    ) -> std::io::Result<()> {
        let slot = self.shared.streams.lock().unwrap().remove(&stream);
        let Some(mut slot) = slot else { return drop_bytes(read, len, scratch).await };
        let mut left = len;
        let server = &self.shared.server;
        let failed = match (slot.status, slot.target.as_mut()) {
            (None, _) => Some(ClientError::Malformed {
                server: server.clone(),
                message: format!("{}: body bytes before the response's head", slot.path),
            }),
            (Some(status), _) if !(200..300).contains(&status) => {
                let keep = left.min(ERROR_BODY.saturating_sub(slot.error_body.len()));
                let at = slot.error_body.len();
                slot.error_body.resize(at + keep, 0);
                read.read_exact(&mut slot.error_body[at..]).await?;
                left -= keep;
                None
            }
            (Some(_), Some(target)) if target.len() + len as u64 > slot.expect => Some(ClientError::Malformed {
                server: server.clone(),
                message: format!("{}: the body ran past {} bytes, {}", slot.path, slot.expect, target.bound()),
            }),
            (Some(_), Some(Target::Whole(whole))) => {
                let at = whole.bytes.len();
                whole.bytes.resize(at + left, 0);
                read.read_exact(&mut whole.bytes[at..]).await?;
                self.shared.progressed(&slot.want, left as u64);
                left = 0;
                None
            }
            (Some(_), Some(Target::Sink(Sink::File(file)))) if file.is_recycled() => {
                // Straight into the recycled file's pages (already there: no page to zero), one copy.
                let mut failed = None;
                while left > 0 {
                    let n = {
                        let spare = file.spare(left).unwrap_or_default();
                        if spare.is_empty() {
                            let message = format!("{}: the body ran past its memory file", slot.path);
                            failed = Some(ClientError::Malformed { server: server.clone(), message });
                            break;
                        }
                        let mut room = tokio::io::ReadBuf::new(spare);
                        std::future::poll_fn(|cx| std::pin::Pin::new(&mut *read).poll_read(cx, &mut room)).await?;
                        room.filled().len()
                    };
                    if n == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    left -= n;
                    self.shared.progressed(&slot.want, n as u64);
                    self.shared.heard();
                    file.commit(n, &mut slot.crc);
                }
                failed
            }
            (Some(_), Some(Target::Sink(sink @ Sink::File(_)))) => {
                // The frame's bytes, in pieces of their own that the file holds until its span is whole
                // and writes in one `writev` (see `MemoryFile`: writing them straight into the file's
                // pages made the kernel zero each page first, which cost more than this copy). From
                // malloc's heap: a piece is at most [`PIECE_BYTES`], under its mmap threshold.
                let mut failed = None;
                while left > 0 && failed.is_none() {
                    let want = left.min(PIECE_BYTES);
                    let mut piece = bytes::BytesMut::with_capacity(want);
                    while piece.len() < want {
                        // At most the piece's rest, whatever room it has.
                        let rest = (want - piece.len()) as u64;
                        let n = (&mut *read).take(rest).read_buf(&mut piece).await?;
                        if n == 0 {
                            return Err(std::io::ErrorKind::UnexpectedEof.into());
                        }
                        // Every byte counts: the stall rule weighs the bytes others got against rounds of frames.
                        self.shared.progressed(&slot.want, n as u64);
                        self.shared.heard();
                    }
                    left -= want;
                    failed =
                        sink.append(&piece.freeze(), &mut slot.crc).err().map(|e| ClientError::appending(server, e));
                }
                failed
            }
            (Some(_), Some(Target::Sink(Sink::Buffer(filling)))) => {
                let mut failed = None;
                while left > 0 {
                    // Straight into the buffer, past its verified prefix.
                    let mut room = tokio::io::ReadBuf::uninit(filling.spare(left));
                    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *read).poll_read(cx, &mut room)).await?;
                    let n = room.filled().len();
                    if n == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    left -= n;
                    self.shared.progressed(&slot.want, n as u64);
                    self.shared.heard();
                    // SAFETY: `room` is the room `spare` gave, and the read reports its first `n` bytes
                    // filled: initialized, as `ReadBuf` guarantees of what it counts as filled.
                    if let Err(e) = unsafe { filling.commit(n, &mut slot.crc) } {
                        failed = Some(ClientError::appending(server, e));
                        break;
                    }
                }
                failed
            }
            (Some(_), None) => None,
        };
        drop_bytes(read, left, scratch).await?;
        match failed {
            Some(e) => {
                let _ = self.out.send(Out::Frame(frames::rst_stream(stream, code::CANCEL)));
                let _ = slot.done.send(Err(e));
            }
            None => self.put_back(stream, slot),
        }
        Ok(())
    }

    fn put_back(&self, stream: u32, slot: Slot) {
        let mut streams = self.shared.streams.lock().unwrap();
        if !slot.want.cancelled.load(Ordering::Acquire) {
            streams.insert(stream, slot);
        }
    }

    fn event(&mut self, event: Event) -> Result<(), FrameError> {
        match event {
            Event::Headers { stream, block, end_stream } => self.head(stream, &block, end_stream)?,
            Event::DataEnd { stream, flow, end_stream } => {
                self.window = self.window.checked_sub(flow).ok_or_else(|| FrameError {
                    code: code::FLOW_CONTROL_ERROR,
                    what: "the server sent past the connection's window".into(),
                })?;
                self.unacked += flow;
                if self.unacked >= CONNECTION_WINDOW / 4 {
                    let _ = self.out.send(Out::Frame(frames::window_update(0, self.unacked)));
                    self.window += self.unacked;
                    self.unacked = 0;
                }
                let mut streams = self.shared.streams.lock().unwrap();
                if end_stream {
                    let slot = streams.remove(&stream);
                    drop(streams);
                    if let Some(slot) = slot {
                        self.complete(slot);
                    }
                } else if let Some(slot) = streams.get_mut(&stream) {
                    slot.unacked += flow;
                    if slot.unacked >= STREAM_WINDOW / 4 {
                        let _ = self.out.send(Out::Frame(frames::window_update(stream, slot.unacked)));
                        slot.unacked = 0;
                    }
                }
            }
            Event::Reset { stream, code } => {
                if let Some(slot) = self.shared.streams.lock().unwrap().remove(&stream) {
                    let what = format!("{}: the server reset the stream ({})", slot.path, frames::code_name(code));
                    let _ = slot.done.send(Err(self.shared.error(what)));
                }
            }
            Event::Settings { ack: false, values } => {
                for (id, value) in values {
                    match id {
                        setting::MAX_FRAME_SIZE => self.shared.peer_max_frame.store(value, Ordering::Release),
                        setting::MAX_CONCURRENT_STREAMS => self.streams_allowed(value as usize),
                        _ => {}
                    }
                }
                self.acknowledge(frames::settings_ack())?;
            }
            Event::Ping { ack: false, data } => self.acknowledge(frames::ping_ack(data))?,
            Event::GoAway { last_stream, code, debug } => {
                self.shared.going_away.store(true, Ordering::Release);
                let what = format!(
                    "the server is closing the connection ({}{}{})",
                    frames::code_name(code),
                    if debug.is_empty() { "" } else { ": " },
                    String::from_utf8_lossy(&debug)
                );
                let gone: Vec<Slot> = {
                    let mut streams = self.shared.streams.lock().unwrap();
                    let ids: Vec<u32> = streams.keys().copied().filter(|&id| id > last_stream).collect();
                    ids.iter().filter_map(|id| streams.remove(id)).collect()
                };
                for slot in gone {
                    let _ = slot.done.send(Err(self.shared.not_sent(what.clone())));
                }
            }
            Event::Settings { ack: true, .. } | Event::Ping { ack: true, .. } => {}
            Event::WindowUpdate { .. } | Event::Ignored => {}
        }
        Ok(())
    }

    /// Queues the acknowledgement of a PING or SETTINGS; a server that sent [`CONTROL_QUEUED`] of them
    /// whose acknowledgements wait to be written (it reads none: our socket's buffer is full) is told to
    /// calm down, its connection ended: else each one it sends is a frame more held in our memory.
    fn acknowledge(&self, frame: Vec<u8>) -> Result<(), FrameError> {
        if self.shared.control.fetch_add(1, Ordering::AcqRel) >= CONTROL_QUEUED {
            let what =
                format!("the server sent {CONTROL_QUEUED} PINGs or SETTINGS whose acknowledgements it did not read");
            return Err(FrameError { code: code::ENHANCE_YOUR_CALM, what });
        }
        let _ = self.out.send(Out::Control(frame));
        Ok(())
    }

    /// The server's SETTINGS_MAX_CONCURRENT_STREAMS: the permits follow it. Those in use when it is
    /// lowered are forgotten as they are given back ([`Shared::owed`]), so that no more streams than it
    /// allows are ever open; raised, what is still owed is forgiven first.
    fn streams_allowed(&mut self, allowed: usize) {
        let allowed = allowed.min(Semaphore::MAX_PERMITS);
        let owed = &self.shared.owed;
        if allowed > self.streams_allowed {
            let more = allowed - self.streams_allowed;
            let forgiven = owed.fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| Some(o - o.min(more)));
            let forgiven = forgiven.map_or(0, |o| o.min(more));
            self.shared.permits.add_permits(more - forgiven);
        } else {
            let fewer = self.streams_allowed - allowed;
            let forgotten = self.shared.permits.forget_permits(fewer);
            owed.fetch_add(fewer - forgotten, Ordering::AcqRel);
        }
        self.streams_allowed = allowed;
    }

    /// A response's head (or trailers) for `stream`: its status and the fields the body needs, checked
    /// against what was asked.
    fn head(&mut self, stream: u32, block: &[u8], end_stream: bool) -> Result<(), FrameError> {
        // Decoded whatever the stream (HPACK's table is the connection's), keeping only the fields used,
        // and no more of them than a head needs, however much a block expands to.
        let mut head = Head::default();
        self.decoder.decode(block, |name, value| head.field(name, value)).map_err(|e| FrameError {
            code: code::COMPRESSION_ERROR,
            what: format!("a header block that does not decode: {e}"),
        })?;
        let mut streams = self.shared.streams.lock().unwrap();
        let Some(slot) = streams.get_mut(&stream) else { return Ok(()) };
        self.shared.progressed(&slot.want, 1);
        if slot.status.is_some() {
            // Trailers: nothing of the body.
            if end_stream {
                let slot = streams.remove(&stream).expect("found above");
                drop(streams);
                self.complete(slot);
            }
            return Ok(());
        }
        let malformed = |what: String| ClientError::Malformed { server: self.shared.server.clone(), message: what };
        let status = head.status.filter(|s| (100..600).contains(s));
        let failed = match status {
            None => Some(malformed(format!("{}: a response with no valid :status", slot.path))),
            // An interim response: the real one follows.
            Some(s) if s < 200 && !end_stream => return Ok(()),
            Some(s) if s < 200 => Some(malformed(format!("{}: a stream ended with an interim response", slot.path))),
            Some(s)
                if head
                    .index_id
                    .as_deref()
                    .is_some_and(|got| slot.want.index_id.as_deref().is_some_and(|w| w != got)) =>
            {
                // Another index than the one asked for: none of its body is taken, whatever its status.
                let mut slot = streams.remove(&stream).expect("found above");
                drop(streams);
                if !end_stream {
                    let _ = self.out.send(Out::Frame(frames::rst_stream(stream, code::CANCEL)));
                }
                let sink = match slot.target.take() {
                    Some(Target::Sink(sink)) => Some(sink),
                    _ => None,
                };
                let index_id = head.index_id.unwrap_or_default();
                self.shared.answered.store(true, Ordering::Release);
                let _ = slot.done.send(Ok(Reply {
                    status: s,
                    retry_after: None,
                    body: Ok(Got::OtherIndex { index_id, sink }),
                }));
                return Ok(());
            }
            Some(s) => {
                slot.status = Some(s);
                if s == 503 {
                    slot.retry_after = head.retry_after.map(|v| v.trim().parse::<u64>().unwrap_or(1));
                }
                if let Some(Target::Whole(whole)) = slot.target.as_mut() {
                    whole.index_id = head.index_id.take();
                }
                if !(200..300).contains(&s) {
                    None
                } else if let Some(len) = head.content_length.filter(|&len| len > slot.expect) {
                    let bound = slot.target.as_ref().map_or("", Target::bound);
                    Some(malformed(format!(
                        "{}: the response announced {len} bytes, past {} bytes, {bound}",
                        slot.path, slot.expect
                    )))
                } else if slot.range_from > 0 && s != 206 {
                    Some(malformed(format!(
                        "{}: asked for bytes from {}, got the whole file",
                        slot.path, slot.range_from
                    )))
                } else {
                    if let (Some(Target::Sink(sink)), Some(value)) = (slot.target.as_mut(), &head.checkpoints) {
                        // Malformed, or not this manifest's body: the body is then released only whole.
                        let parsed = api::parse_checkpoints(value);
                        if !parsed.is_some_and(|c| sink.expect_checkpoints(c)) && matches!(sink, Sink::Buffer(_)) {
                            tracing::debug!(server = %self.shared.server, path = slot.path, "checkpoints not used");
                        }
                    }
                    None
                }
            }
        };
        if let Some(e) = failed {
            let slot = streams.remove(&stream).expect("found above");
            drop(streams);
            let _ = self.out.send(Out::Frame(frames::rst_stream(stream, code::CANCEL)));
            let _ = slot.done.send(Err(e));
        } else if end_stream {
            let slot = streams.remove(&stream).expect("found above");
            drop(streams);
            self.complete(slot);
        }
        Ok(())
    }

    fn complete(&self, mut slot: Slot) {
        let reply = Reply {
            status: slot.status.unwrap_or(0),
            retry_after: slot.retry_after,
            body: match slot.status {
                Some(s) if (200..300).contains(&s) => Ok(match slot.target.take().expect("a success has its target") {
                    Target::Sink(sink) => Got::Body(Body { sink, crc32c: slot.crc }),
                    Target::Whole(whole) => Got::Whole(whole),
                }),
                _ => Err(std::mem::take(&mut slot.error_body)),
            },
        };
        self.shared.answered.store(true, Ordering::Release);
        let _ = slot.done.send(Ok(reply));
    }
}

/// The fields of a response's head that the mount reads.
#[derive(Default)]
struct Head {
    status: Option<u16>,
    content_length: Option<u64>,
    retry_after: Option<String>,
    checkpoints: Option<String>,
    index_id: Option<String>,
}

impl Head {
    fn field(&mut self, name: &[u8], value: &[u8]) {
        let text = || std::str::from_utf8(value).ok().filter(|v| v.len() <= ERROR_BODY).map(str::to_owned);
        match name {
            b":status" => self.status = text().and_then(|v| v.parse().ok()),
            b"content-length" => self.content_length = text().and_then(|v| v.trim().parse().ok()),
            b"retry-after" => self.retry_after = text(),
            n if n == api::CHECKPOINTS_HEADER.as_bytes() => self.checkpoints = text(),
            // An empty id says nothing (as the API has it): taken as no id, not compared.
            n if n == api::INDEX_ID_HEADER.as_bytes() => self.index_id = text().filter(|v| !v.trim().is_empty()),
            _ => {}
        }
    }
}

/// A connection's reading side read [`INBOX`] bytes at a time for what is small (frame headers, small
/// frames, the first bytes of a body's frame), so a frame does not cost a `recv` of its 9-byte header; a
/// read of at least as much (the rest of a body's frame) goes straight to the socket, into the caller's
/// memory.
pub(super) struct Buffered<R> {
    read: R,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Reads take only what they ask for (when the inbox is empty), none of what follows.
    alone: bool,
}

/// What [`Buffered`] reads at most at once for small reads from a socket. Measured: a `recv` per frame
/// header made ImageFolder over `shuffled/` (samples of one frame or a few) 1.03–1.27x slower than
/// hyper's connection; with the inbox 0.95–1.01x (docs/BENCHMARKS.md, "One copy").
pub const INBOX: usize = 16 << 10;

/// The most bytes of a frame bound for a fresh memory file read into one piece: from malloc's heap,
/// under its mmap threshold (256 KiB, see [`crate::sys`]), where a larger piece would be a fresh mapping
/// faulted in page by page and unmapped again, which cost more than the copy of its bytes.
pub const PIECE_BYTES: usize = 128 << 10;

impl<R: AsyncRead + Unpin> Buffered<R> {
    pub(super) fn new(read: R, inbox: usize) -> Self {
        Buffered { read, buf: vec![0; inbox].into_boxed_slice(), start: 0, end: 0, alone: false }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Buffered<R> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        out: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.start == this.end {
            if this.alone || out.remaining() >= this.buf.len() {
                return std::pin::Pin::new(&mut this.read).poll_read(cx, out);
            }
            let mut fill = tokio::io::ReadBuf::new(&mut this.buf);
            std::task::ready!(std::pin::Pin::new(&mut this.read).poll_read(cx, &mut fill))?;
            (this.start, this.end) = (0, fill.filled().len());
        }
        let n = out.remaining().min(this.end - this.start);
        out.put_slice(&this.buf[this.start..this.start + n]);
        this.start += n;
        std::task::Poll::Ready(Ok(()))
    }
}

/// Reads and drops `len` bytes.
async fn drop_bytes<R: AsyncRead + Unpin>(read: &mut R, mut len: usize, scratch: &mut [u8]) -> std::io::Result<()> {
    while len > 0 {
        let n = len.min(scratch.len());
        read.read_exact(&mut scratch[..n]).await?;
        len -= n;
    }
    Ok(())
}
