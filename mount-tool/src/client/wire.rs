//! The mount's own HTTP/2 connection, for bodies: each DATA frame's bytes are read from the socket
//! straight into the memory file or buffer its body goes to ([`Sink::spare`]), the CRC32C extended over
//! them right after (while they are in the CPU's caches), so a body is copied once, by the kernel's
//! receive, where hyper's connection read each frame into a buffer of its own that was then copied into
//! the memory file (two copies: 48 % of the daemon's CPU under DALI, docs/BENCHMARKS.md). Over TLS the
//! one copy is rustls's, out of its decrypted record.
//!
//! The frames are read by [`batchfs::frames::FrameReader`], which checks every length, flag and stream
//! id; response heads are decoded by `loona-hpack`; requests are written with no HPACK state
//! ([`batchfs::frames::request_block`]). A connection is two tasks: the writer (the preface and
//! SETTINGS, then requests and the frames the reader asks for, batched) and the reader (frames, into
//! their streams' sinks). Flow control: the connection's window is [`CONNECTION_WINDOW`] and each
//! stream's [`STREAM_WINDOW`], given back as bytes arrive (a body is taken as fast as it comes: its
//! sink is as large as its announced size, and the prefetcher bounds how many are in flight). Streams
//! are limited by the server's SETTINGS_MAX_CONCURRENT_STREAMS.
//!
//! What hyper did for the JSON requests it still does (`client/http.rs`); this carries every body
//! ([`super::BatchClient::fetch_body`]).

use super::{Body, ClientError, Sink};
use batchfs::api;
use batchfs::frames::{self, code, setting, Event, FrameError, FrameReader, Next};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

/// The connection's receive window (what the server may send before we give bytes back).
pub const CONNECTION_WINDOW: u32 = 64 << 20;
/// Each stream's receive window.
pub const STREAM_WINDOW: u32 = 16 << 20;
/// Streams open at once before the server's SETTINGS say how many it takes (RFC 9113 6.5.2 asks a server
/// for at least 100).
const INITIAL_STREAMS: usize = 100;
/// The most of an error response's body kept (the JSON of an error is a line).
const ERROR_BODY: usize = 64 << 10;

/// One request's answer.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// `Retry-After` in seconds, where the server sent one (a bad value reads as 1).
    pub retry_after: Option<u64>,
    /// The body in its sink (a success), or the first bytes of an error's body.
    pub body: Result<Body, Vec<u8>>,
}

/// What one request asks for.
pub struct Ask<'a> {
    pub path_and_query: &'a str,
    /// Extra header fields (lower-case names).
    pub fields: &'a [(&'a str, &'a str)],
    /// The most body bytes taken: the manifest's size.
    pub expect: u64,
    /// The first byte asked for by a `Range` (a reply from 0 to a range that does not start at 0 is
    /// refused).
    pub range_from: u64,
}

/// One HTTP/2 connection to a server; see the module's docs.
pub struct Wire {
    server: String,
    shared: Arc<Shared>,
    out: mpsc::UnboundedSender<Out>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

struct Shared {
    server: String,
    streams: Mutex<HashMap<u32, Slot>>,
    /// Set once the connection has ended (nothing new starts on it).
    ended: AtomicBool,
    /// Set by a GOAWAY, or when stream ids run out: streams begun go on, new ones go elsewhere.
    going_away: AtomicBool,
    /// Streams the server takes at once.
    permits: Arc<Semaphore>,
    /// The largest frame the server takes (for our HEADERS).
    peer_max_frame: AtomicU32,
    /// When the last frame came (milliseconds since `born`).
    last_frame: AtomicU64,
    born: Instant,
}

/// A stream, as its requester and the connection share it.
struct Want {
    id: AtomicU32,
    cancelled: AtomicBool,
    /// Bumped by every head and body byte: what the requester's stall timer watches.
    progress: AtomicU64,
}

/// A stream's state in the reader.
struct Slot {
    want: Arc<Want>,
    expect: u64,
    range_from: u64,
    sink: Option<Sink>,
    crc: u32,
    status: Option<u16>,
    retry_after: Option<u64>,
    error_body: Vec<u8>,
    /// Bytes taken and not yet given back to the server's window for this stream.
    unacked: u32,
    path: String,
    done: oneshot::Sender<Result<Reply, ClientError>>,
    _permit: OwnedSemaphorePermit,
}

enum Out {
    Request { block: Vec<u8>, slot: Slot },
    Frame(Vec<u8>),
}

impl Wire {
    /// Speaks HTTP/2 over `io` (a connection to `base_url`'s server, `https` over TLS): sends the
    /// preface and SETTINGS (frames up to `max_frame`), and reads until the connection ends.
    pub fn start<S>(io: S, base_url: &str, max_frame: u32) -> Arc<Wire>
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let shared = Arc::new(Shared {
            server: base_url.to_owned(),
            streams: Mutex::new(HashMap::new()),
            ended: AtomicBool::new(false),
            going_away: AtomicBool::new(false),
            permits: Arc::new(Semaphore::new(INITIAL_STREAMS)),
            peer_max_frame: AtomicU32::new(frames::DEFAULT_MAX_FRAME),
            last_frame: AtomicU64::new(0),
            born: Instant::now(),
        });
        let (read, write) = tokio::io::split(io);
        let (out, rx) = mpsc::unbounded_channel();
        let reader = FrameReader::new(max_frame);
        let hello = [
            frames::PREFACE.to_vec(),
            frames::settings(&[
                (setting::ENABLE_PUSH, 0),
                (setting::MAX_CONCURRENT_STREAMS, 0),
                (setting::INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                (setting::MAX_FRAME_SIZE, reader.max_frame()),
            ]),
            frames::window_update(0, CONNECTION_WINDOW - frames::DEFAULT_WINDOW),
        ]
        .concat();
        let writer = tokio::spawn(write_loop(write, rx, shared.clone(), hello));
        let reading = Reading {
            shared: shared.clone(),
            out: out.clone(),
            reader,
            decoder: loona_hpack::Decoder::new(),
            window: CONNECTION_WINDOW,
            unacked: 0,
            streams_allowed: INITIAL_STREAMS,
        };
        let reader = tokio::spawn(reading.run(read));
        Arc::new(Wire { server: base_url.to_owned(), shared, out, tasks: vec![writer, reader] })
    }

    /// Whether a new request may start here.
    pub fn usable(&self) -> bool {
        !self.shared.ended.load(Ordering::Acquire) && !self.shared.going_away.load(Ordering::Acquire)
    }

    /// GETs `ask`, its body into `sink`; gives up after `stall` without a byte (the stream is then reset,
    /// and the connection too if nothing at all came on it meanwhile).
    pub async fn get(&self, ask: Ask<'_>, sink: Sink, stall: Duration) -> Result<Reply, ClientError> {
        let stalled = || ClientError::Stalled { server: self.server.clone(), after: stall };
        let permit = tokio::time::timeout(stall, self.shared.permits.clone().acquire_owned())
            .await
            .map_err(|_| stalled())?
            .map_err(|_| self.ended("the connection has ended"))?;
        let want =
            Arc::new(Want { id: AtomicU32::new(0), cancelled: AtomicBool::new(false), progress: AtomicU64::new(0) });
        let (done, mut answer) = oneshot::channel();
        let slot = Slot {
            want: want.clone(),
            expect: ask.expect,
            range_from: ask.range_from,
            sink: Some(sink),
            crc: 0,
            status: None,
            retry_after: None,
            error_body: Vec::new(),
            unacked: 0,
            path: ask.path_and_query.to_owned(),
            done,
            _permit: permit,
        };
        let block = self.request_block(&ask);
        self.out.send(Out::Request { block, slot }).map_err(|_| self.ended("the connection has ended"))?;
        let mut cancel = Cancel { want: &want, shared: &self.shared, out: &self.out, armed: true };
        let mut seen = 0;
        loop {
            match tokio::time::timeout(stall, &mut answer).await {
                Ok(Ok(reply)) => {
                    cancel.armed = false;
                    return reply;
                }
                Ok(Err(_)) => {
                    cancel.armed = false;
                    return Err(self.ended("the connection ended under the request"));
                }
                Err(_) => {
                    let now = want.progress.load(Ordering::Acquire);
                    if now == seen {
                        let quiet = self.shared.millis() - self.shared.last_frame.load(Ordering::Acquire);
                        if Duration::from_millis(quiet) >= stall {
                            // Nothing at all came on the connection: it is taken as dead.
                            self.shared.ended.store(true, Ordering::Release);
                        }
                        return Err(stalled());
                    }
                    seen = now;
                }
            }
        }
    }

    fn request_block(&self, ask: &Ask<'_>) -> Vec<u8> {
        let (https, authority) = match self.server.split_once("://") {
            Some((scheme, rest)) => (scheme == "https", rest.trim_end_matches('/')),
            None => (false, self.server.as_str()),
        };
        frames::request_block(https, authority, ask.path_and_query, ask.fields)
    }

    fn ended(&self, what: &str) -> ClientError {
        ClientError::Unreachable {
            server: self.server.clone(),
            cause: Arc::new(std::io::Error::other(what.to_owned())),
        }
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        self.shared.ended.store(true, Ordering::Release);
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Resets a request's stream when its requester gives up on it (dropped, or stalled).
struct Cancel<'a> {
    want: &'a Arc<Want>,
    shared: &'a Arc<Shared>,
    out: &'a mpsc::UnboundedSender<Out>,
    armed: bool,
}

impl Drop for Cancel<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.want.cancelled.store(true, Ordering::Release);
        let id = self.want.id.load(Ordering::Acquire);
        if id != 0 {
            // Dropped here, or by the reader (which checks `cancelled` under this lock) if it holds it.
            drop(self.shared.streams.lock().unwrap().remove(&id));
            let _ = self.out.send(Out::Frame(frames::rst_stream(id, code::CANCEL)));
        }
    }
}

impl Shared {
    fn millis(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    fn error(&self, what: impl Into<String>) -> ClientError {
        ClientError::Unreachable { server: self.server.clone(), cause: Arc::new(std::io::Error::other(what.into())) }
    }

    /// Ends every stream with `why`; nothing new starts.
    fn end(&self, why: &ClientError) {
        self.ended.store(true, Ordering::Release);
        self.permits.close();
        let slots: Vec<Slot> = self.streams.lock().unwrap().drain().map(|(_, s)| s).collect();
        for slot in slots {
            let _ = slot.done.send(Err(why.clone()));
        }
    }
}

/// Writes the preface, then requests and the reader's frames, as many at once as are waiting.
async fn write_loop<W: AsyncWrite>(
    write: W,
    mut rx: mpsc::UnboundedReceiver<Out>,
    shared: Arc<Shared>,
    hello: Vec<u8>,
) {
    let mut write = std::pin::pin!(write);
    let mut next_id: u32 = 1;
    let mut buf = hello;
    loop {
        if !buf.is_empty() {
            if let Err(e) = async {
                write.write_all(&buf).await?;
                write.flush().await
            }
            .await
            {
                shared.end(&ClientError::unreachable(shared.server.clone(), e));
                return;
            }
            buf.clear();
        }
        let Some(first) = rx.recv().await else { return };
        let mut next = Some(first);
        while let Some(out) = next {
            match out {
                Out::Frame(f) => buf.extend_from_slice(&f),
                Out::Request { block, slot } => {
                    if shared.ended.load(Ordering::Acquire) {
                        let _ = slot.done.send(Err(shared.error("the connection has ended")));
                    } else if next_id > frames::MAX_WINDOW {
                        shared.going_away.store(true, Ordering::Release);
                        let _ = slot.done.send(Err(shared.error("the connection's stream ids ran out")));
                    } else {
                        let id = next_id;
                        next_id += 2;
                        slot.want.id.store(id, Ordering::Release);
                        let cancelled = {
                            let mut streams = shared.streams.lock().unwrap();
                            let cancelled = slot.want.cancelled.load(Ordering::Acquire);
                            if !cancelled {
                                streams.insert(id, slot);
                            }
                            cancelled
                        };
                        if !cancelled {
                            let max = shared.peer_max_frame.load(Ordering::Acquire);
                            buf.extend_from_slice(&frames::headers(id, &block, max, true));
                        }
                    }
                }
            }
            next = if buf.len() < (256 << 10) { rx.try_recv().ok() } else { None };
        }
    }
}

/// The reader's state: see [`Reading::run`].
struct Reading {
    shared: Arc<Shared>,
    out: mpsc::UnboundedSender<Out>,
    reader: FrameReader,
    /// What the server may still send on the connection.
    window: u32,
    /// Bytes taken and not yet given back to the connection's window.
    unacked: u32,
    /// HPACK's state for the server's heads.
    decoder: loona_hpack::Decoder<'static>,
    /// The streams the server takes at once, as last announced.
    streams_allowed: usize,
}

/// Why reading stopped.
enum Stop {
    Io(std::io::Error),
    Protocol(FrameError),
}

impl Reading {
    async fn run<R: AsyncRead>(mut self, read: R) {
        let mut read = std::pin::pin!(read);
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

    async fn frames<R: AsyncRead>(&mut self, read: &mut std::pin::Pin<&mut R>) -> Stop {
        let mut small = vec![0u8; self.reader.max_frame() as usize];
        loop {
            let event = match self.reader.next() {
                Next::Head => {
                    let mut head = [0u8; frames::HEADER_LEN];
                    if let Err(e) = read.read_exact(&mut head).await {
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
                    if let Err(e) = self.data(read, stream, len, &mut small).await {
                        return Stop::Io(e);
                    }
                    Ok(self.reader.data_read())
                }
            };
            self.shared.last_frame.store(self.shared.millis(), Ordering::Release);
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
    async fn data<R: AsyncRead>(
        &mut self,
        read: &mut std::pin::Pin<&mut R>,
        stream: u32,
        len: usize,
        scratch: &mut [u8],
    ) -> std::io::Result<()> {
        let slot = self.shared.streams.lock().unwrap().remove(&stream);
        let Some(mut slot) = slot else { return drop_bytes(read, len, scratch).await };
        let mut left = len;
        let failed = match (slot.status, slot.sink.as_mut()) {
            (None, _) => Some(ClientError::Malformed {
                server: self.shared.server.clone(),
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
            (Some(_), Some(sink)) if sink.len() + len as u64 > slot.expect => Some(ClientError::Malformed {
                server: self.shared.server.clone(),
                message: format!("{}: the body ran past {} bytes, the manifest's size", slot.path, slot.expect),
            }),
            (Some(_), Some(sink)) => {
                let mut failed = None;
                while left > 0 {
                    let mut room = sink.spare(left).map_err(std::io::Error::other)?;
                    if room.remaining() == 0 {
                        break;
                    }
                    std::future::poll_fn(|cx| read.as_mut().poll_read(cx, &mut room)).await?;
                    let n = room.filled().len();
                    if n == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    left -= n;
                    slot.want.progress.fetch_add(n as u64, Ordering::Release);
                    if let Err(e) = sink.commit(n, &mut slot.crc) {
                        failed = Some(ClientError::appending(&self.shared.server, e));
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
                let _ = self.out.send(Out::Frame(frames::settings_ack()));
            }
            Event::Ping { ack: false, data } => {
                let _ = self.out.send(Out::Frame(frames::ping_ack(data)));
            }
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
                    let _ = slot.done.send(Err(self.shared.error(what.clone())));
                }
            }
            Event::Settings { ack: true, .. } | Event::Ping { ack: true, .. } => {}
            Event::WindowUpdate { .. } | Event::Ignored => {}
        }
        Ok(())
    }

    /// The server's SETTINGS_MAX_CONCURRENT_STREAMS: the permits follow it (those in use are kept).
    fn streams_allowed(&mut self, allowed: usize) {
        let allowed = allowed.min(Semaphore::MAX_PERMITS);
        if allowed > self.streams_allowed {
            self.shared.permits.add_permits(allowed - self.streams_allowed);
        } else {
            self.shared.permits.forget_permits(self.streams_allowed - allowed);
        }
        self.streams_allowed = allowed;
    }

    /// A response's head (or trailers) for `stream`: its status and the fields the body needs, checked
    /// against what was asked.
    fn head(&mut self, stream: u32, block: &[u8], end_stream: bool) -> Result<(), FrameError> {
        // Decoded whatever the stream (HPACK's table is the connection's), keeping only the fields used,
        // and no more of them than a head needs, however much a block expands to.
        let mut head = Head::default();
        self.decoder.decode_with_cb(block, |name, value| head.field(&name, &value)).map_err(|e| FrameError {
            code: code::COMPRESSION_ERROR,
            what: format!("a header block that does not decode: {e}"),
        })?;
        let mut streams = self.shared.streams.lock().unwrap();
        let Some(slot) = streams.get_mut(&stream) else { return Ok(()) };
        slot.want.progress.fetch_add(1, Ordering::Release);
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
            Some(s) => {
                slot.status = Some(s);
                if s == 503 {
                    slot.retry_after = head.retry_after.map(|v| v.trim().parse::<u64>().unwrap_or(1));
                }
                if !(200..300).contains(&s) {
                    None
                } else if let Some(len) = head.content_length.filter(|&len| len > slot.expect) {
                    Some(malformed(format!(
                        "{}: the response announced {len} bytes, but the manifest announced {} bytes",
                        slot.path, slot.expect
                    )))
                } else if slot.range_from > 0 && s != 206 {
                    Some(malformed(format!(
                        "{}: asked for bytes from {}, got the whole file",
                        slot.path, slot.range_from
                    )))
                } else {
                    let sink = slot.sink.as_mut().expect("a stream has its sink until it ends");
                    if let Some(value) = &head.checkpoints {
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
                Some(s) if (200..300).contains(&s) => {
                    Ok(Body { sink: slot.sink.take().expect("a success has its sink"), crc32c: slot.crc })
                }
                _ => Err(std::mem::take(&mut slot.error_body)),
            },
        };
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
}

impl Head {
    fn field(&mut self, name: &[u8], value: &[u8]) {
        let text = || std::str::from_utf8(value).ok().filter(|v| v.len() <= ERROR_BODY).map(str::to_owned);
        match name {
            b":status" => self.status = text().and_then(|v| v.parse().ok()),
            b"content-length" => self.content_length = text().and_then(|v| v.trim().parse().ok()),
            b"retry-after" => self.retry_after = text(),
            n if n == api::CHECKPOINTS_HEADER.as_bytes() => self.checkpoints = text(),
            _ => {}
        }
    }
}

/// Reads and drops `len` bytes.
async fn drop_bytes<R: AsyncRead>(
    read: &mut std::pin::Pin<&mut R>,
    mut len: usize,
    scratch: &mut [u8],
) -> std::io::Result<()> {
    while len > 0 {
        let n = len.min(scratch.len());
        read.read_exact(&mut scratch[..n]).await?;
        len -= n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffers::Filling;
    use proptest::prelude::*;

    /// The body of `/LEN/SEED`: `LEN` bytes from `SEED`.
    fn body_of(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// The reference: the `h2` crate's server, answering `/LEN/SEED` with that body in pieces of `piece`
    /// bytes (as the flow-control windows let it), `/status/N` with status N and a JSON error, and
    /// `/silent` never.
    async fn reference_server(piece: usize) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(mut conn) = h2::server::handshake(socket).await else { return };
                    while let Some(Ok((request, mut respond))) = conn.accept().await {
                        tokio::spawn(async move {
                            let path = request.uri().path().to_owned();
                            let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
                            if parts == ["silent"] {
                                tokio::time::sleep(Duration::from_secs(3600)).await;
                                return;
                            }
                            if parts[0] == "status" {
                                let status: u16 = parts[1].parse().unwrap();
                                let response = http::Response::builder().status(status).header("retry-after", "7");
                                let mut s = respond.send_response(response.body(()).unwrap(), false).unwrap();
                                let _ = s.send_data(bytes::Bytes::from_static(b"{\"error\": \"no such batch\"}"), true);
                                return;
                            }
                            let (len, seed) = (parts[0].parse().unwrap(), parts[1].parse().unwrap());
                            let body = bytes::Bytes::from(body_of(len, seed));
                            let response = http::Response::builder().status(200).header("content-length", len);
                            let mut s = respond.send_response(response.body(()).unwrap(), len == 0).unwrap();
                            let mut at = 0;
                            while at < len {
                                let n = piece.min(len - at);
                                s.reserve_capacity(n);
                                let Some(Ok(got)) = std::future::poll_fn(|cx| s.poll_capacity(cx)).await else {
                                    return;
                                };
                                let n = got.min(n);
                                if s.send_data(body.slice(at..at + n), at + n == len).is_err() {
                                    return;
                                }
                                at += n;
                            }
                        });
                    }
                });
            }
        });
        format!("http://{addr}")
    }

    async fn wire_to(server: &str) -> Arc<Wire> {
        let socket = tokio::net::TcpStream::connect(server.trim_start_matches("http://")).await.unwrap();
        Wire::start(socket, server, 128 << 10)
    }

    fn sink(len: usize, into_file: bool) -> Sink {
        if into_file {
            Sink::File(crate::buffers::MemoryFile::new(crate::sys::memfd("batchfs-test").unwrap(), len as u64).unwrap())
        } else {
            Sink::Buffer(Filling::new(Vec::new(), (len as u64, 0), None, || {}))
        }
    }

    fn bytes_of(body: Body) -> Vec<u8> {
        match body.sink {
            Sink::Buffer(f) => f.finish().to_vec(),
            Sink::File(m) => {
                let mut file = m.finish().unwrap();
                let mut all = Vec::new();
                std::io::Seek::rewind(&mut file).unwrap();
                std::io::Read::read_to_end(&mut file, &mut all).unwrap();
                all
            }
        }
    }

    async fn get(wire: &Wire, path: &str, expect: usize, into_file: bool) -> Result<Reply, ClientError> {
        let ask = Ask { path_and_query: path, fields: &[("x-test", "1")], expect: expect as u64, range_from: 0 };
        wire.get(ask, sink(expect, into_file), Duration::from_secs(10)).await
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Bodies sent by the reference server, many at once on one connection, in pieces of any size,
        /// arrive whole into buffers and memory files with their CRC32C.
        #[test]
        fn bodies_from_a_reference_server_arrive_whole(
            lens in proptest::collection::vec(0usize..(3 << 20), 1..12),
            piece in 1usize..(300 << 10),
        ) {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            rt.block_on(async {
                let server = reference_server(piece).await;
                let wire = wire_to(&server).await;
                let gets = lens.iter().enumerate().map(|(i, &len)| {
                    let wire = wire.clone();
                    async move {
                        let reply = get(&wire, &format!("/{len}/{i}"), len, i % 2 == 0).await.unwrap();
                        assert_eq!(reply.status, 200);
                        let body = reply.body.unwrap();
                        let want = body_of(len, i as u64);
                        assert_eq!(body.crc32c, crc32c::crc32c(&want));
                        assert!(bytes_of(body) == want, "body {i} of {len} bytes");
                    }
                });
                futures_util::future::join_all(gets).await;
            });
        }
    }

    /// Bodies larger than both windows together arrive: the windows are given back as bytes come.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bodies_past_the_windows_arrive() {
        let server = reference_server(1 << 20).await;
        let wire = wire_to(&server).await;
        let len = (CONNECTION_WINDOW as usize) / 2 + (STREAM_WINDOW as usize) + 12_345;
        let (one, two) = (format!("/{len}/1"), format!("/{len}/2"));
        let (a, b) = tokio::join!(get(&wire, &one, len, true), get(&wire, &two, len, false));
        for (reply, seed) in [(a, 1), (b, 2)] {
            assert!(bytes_of(reply.unwrap().body.unwrap()) == body_of(len, seed));
        }
    }

    /// An error status comes with its body's first bytes and its Retry-After, not into the sink.
    #[tokio::test]
    async fn an_error_status_keeps_its_message() {
        let wire = wire_to(&reference_server(1000).await).await;
        let reply = get(&wire, "/status/503", 100, true).await.unwrap();
        assert_eq!((reply.status, reply.retry_after), (503, Some(7)));
        assert_eq!(reply.body.unwrap_err(), b"{\"error\": \"no such batch\"}");
        let reply = get(&wire, "/status/404", 100, false).await.unwrap();
        assert_eq!((reply.status, reply.retry_after), (404, None));
    }

    /// A body longer than announced is cut off with an error naming the request, and the connection
    /// serves the next request; so does one whose requester gave up (its stream reset).
    #[tokio::test]
    async fn a_stream_cut_off_or_given_up_leaves_the_connection_serving() {
        let wire = wire_to(&reference_server(4096).await).await;
        let err = get(&wire, "/50000/1", 1000, true).await.unwrap_err();
        let named = |m: &str| m.contains("/50000/1") && m.contains("announced 50000");
        assert!(matches!(&err, ClientError::Malformed { message, .. } if named(message)), "{err}");
        let given_up = tokio::time::timeout(Duration::from_millis(50), get(&wire, "/silent", 10, true)).await;
        assert!(given_up.is_err());
        let reply = get(&wire, "/70000/3", 70000, false).await.unwrap();
        assert!(bytes_of(reply.body.unwrap()) == body_of(70000, 3));
        assert!(wire.usable());
        assert!(wire.shared.streams.lock().unwrap().is_empty(), "no stream is left behind");
    }

    /// A response that never comes is abandoned after the stall timeout; a connection on which nothing at
    /// all came meanwhile is no longer used.
    #[tokio::test]
    async fn a_silent_server_stalls_and_its_connection_is_dropped() {
        let wire = wire_to(&reference_server(4096).await).await;
        let ask = Ask { path_and_query: "/silent", fields: &[], expect: 10, range_from: 0 };
        let err = wire.get(ask, sink(10, true), Duration::from_millis(300)).await.unwrap_err();
        assert!(matches!(err, ClientError::Stalled { .. }), "{err}");
        assert!(!wire.usable());
    }

    /// A peer that breaks HTTP/2 ends the connection with an error naming what it broke, and every stream
    /// on it with it; nothing hangs.
    #[tokio::test]
    async fn a_peer_that_breaks_the_protocol_ends_the_connection() {
        for garbage in [
            frames::frame(frames::kind::PUSH_PROMISE, frames::flag::END_HEADERS, 1, &[0, 0, 0, 2]),
            frames::frame(frames::kind::DATA, 0, 1, &[0; 200_000]),
            frames::frame(frames::kind::HEADERS, frames::flag::END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff, 0x0f]),
        ] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let server = format!("http://{}", listener.local_addr().unwrap());
            tokio::spawn(async move {
                let (mut socket, _) = listener.accept().await.unwrap();
                socket.write_all(&frames::settings(&[])).await.unwrap();
                socket.write_all(&garbage).await.unwrap();
                let mut sink = Vec::new();
                let _ = socket.read_to_end(&mut sink).await;
            });
            let wire = wire_to(&server).await;
            let err = get(&wire, "/1/1", 1, true).await.unwrap_err();
            assert!(matches!(&err, ClientError::Malformed { message, .. } if message.contains("HTTP/2")), "{err}");
            assert!(!wire.usable());
        }
    }
}
