//! The mount's own HTTP/2 connection, for bodies. A DATA frame bound for a buffer (what the daemon serves
//! itself) is read from the socket straight into the buffer past its verified prefix
//! ([`crate::buffers::Filling::spare`]), the CRC32C extended over it right after, while it is in the
//! CPU's caches: one copy, the kernel's, where hyper's connection read each frame into a buffer of its
//! own that was then copied into the body's. A frame bound for a memory file is read into a piece of its
//! own that the file writes in whole spans, as before: receiving into the file's pages directly made the
//! kernel zero them first, which cost more than the copy (docs/DESIGN.md, "One copy where it pays"). Over
//! TLS the same reads receive the records into the same memory and open them there ([`super::tls`]).
//!
//! The frames are read by [`batchfs::frames::FrameReader`], which checks every length, flag and stream
//! id; response heads are decoded by [`batchfs::hpack::Decoder`]; requests are written with no HPACK state
//! ([`batchfs::frames::request_block`]). A connection is two tasks: the writer (the preface and
//! SETTINGS, then requests and the frames the reader asks for, batched) and the reader (frames, into
//! their streams' sinks). Flow control: the connection's window is [`CONNECTION_WINDOW`] and each
//! stream's [`STREAM_WINDOW`], given back as bytes arrive (a body is taken as fast as it comes: its
//! sink is as large as its announced size, and the prefetcher bounds how many are in flight). Streams
//! are limited by the server's SETTINGS_MAX_CONCURRENT_STREAMS. A connection quiet for its keepalive
//! interval is sent a PING, and ended when nothing answers it in time ([`keep_alive`]): a dead peer or a
//! path that dropped the connection is found before a request waits out its stall on it, and an idle
//! connection's path (NAT, load balancers) is kept.
//!
//! It carries every request of the mount: bodies ([`super::BatchClient::fetch_body`]) into their sinks,
//! and the small replies (descriptions, manifests, listings, tables) gathered whole ([`Target::Whole`]).

mod reading;

use super::{Body, ClientError, Sink};
pub use reading::INBOX;
use reading::{Buffered, Reading};

use batchfs::frames::{self, code, setting, FrameReader};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

/// The connection's receive window (what the server may send before we give bytes back).
pub const CONNECTION_WINDOW: u32 = 64 << 20;
/// Each stream's receive window.
pub const STREAM_WINDOW: u32 = 16 << 20;
/// Streams open at once before the server's SETTINGS say how many it takes (RFC 9113 6.5.2 asks a server
/// for at least 100).
const INITIAL_STREAMS: usize = 100;
/// A stream with no byte of its own waits behind the other streams of its connection while they receive
/// (a narrow link's frames are sent in turn; see [`Wire::get`]), for at most this many stall timeouts.
pub const QUEUED_STALLS: u32 = 6;
/// The most of an error response's body kept (the JSON of an error is a line).
const ERROR_BODY: usize = 64 << 10;
/// Acknowledgements of the server's PINGs and SETTINGS waiting to be written at most: a server that sends
/// more while it reads none of them (each one a frame queued in our memory) is told to calm down, and the
/// connection is ended.
const CONTROL_QUEUED: usize = 1024;

/// One request's answer.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// `Retry-After` in seconds, where the server sent one (a bad value reads as 1).
    pub retry_after: Option<u64>,
    /// What a success delivered, or the first bytes of an error's body.
    pub body: Result<Got, Vec<u8>>,
}

/// Where a request's body goes.
pub enum Target {
    /// A body's sink, of the manifest's size ([`Ask::expect`]).
    Sink(Sink),
    /// A small reply (JSON, the sample table), gathered whole, of at most [`Ask::expect`] bytes.
    Whole(Whole),
}

/// A small reply as it arrives: its bytes, and the index id its head gave
/// ([`batchfs::api::INDEX_ID_HEADER`]), if any.
#[derive(Debug, Default)]
pub struct Whole {
    pub bytes: Vec<u8>,
    pub index_id: Option<String>,
}

impl Target {
    /// Bytes taken so far.
    fn len(&self) -> u64 {
        match self {
            Target::Sink(sink) => sink.len(),
            Target::Whole(whole) => whole.bytes.len() as u64,
        }
    }

    /// What bounds the body, for an error saying it went past it.
    fn bound(&self) -> &'static str {
        match self {
            Target::Sink(_) => "the manifest's size",
            Target::Whole(_) => "the most a reply may hold",
        }
    }
}

/// What a success delivered: its target, filled.
#[derive(Debug)]
pub enum Got {
    /// A body in its sink, with its CRC32C.
    Body(Body),
    Whole(Whole),
    /// A reply (of any status) whose head named `index_id`, not the index asked for ([`Ask::index_id`]):
    /// the stream was cancelled at its head, and its sink comes back with none of its bytes (a small
    /// reply's gathering has none to give back).
    OtherIndex {
        index_id: String,
        sink: Option<Sink>,
    },
}

/// What one request asks for.
pub struct Ask<'a> {
    pub path_and_query: &'a str,
    /// Extra header fields (lower-case names).
    pub fields: &'a [(&'a str, &'a str)],
    /// The most body bytes taken: the manifest's size, or the most a small reply may hold.
    pub expect: u64,
    /// The first byte asked for by a `Range` (a reply from 0 to a range that does not start at 0 is
    /// refused).
    pub range_from: u64,
    /// The index of the dataset the reply must be of: one whose head names another
    /// ([`batchfs::api::INDEX_ID_HEADER`]) is [`Got::OtherIndex`]; none: nothing compared.
    pub index_id: Option<Arc<str>>,
}

/// One HTTP/2 connection to a server; see the module's docs.
pub struct Wire {
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
    /// Set once a stream has had its reply (of any status): the server took streams on this connection.
    answered: AtomicBool,
    /// Streams the server takes at once.
    permits: Arc<Semaphore>,
    /// The largest frame the server takes (for our HEADERS).
    peer_max_frame: AtomicU32,
    /// When the server's last bytes came, a whole frame or part of a body's (milliseconds since `born`).
    last_heard: AtomicU64,
    /// Every stream's [`Want::progress`] together: while it moves, a stream with none of its own is
    /// queued behind the others on a busy link, not stalled (for at most [`QUEUED_STALLS`] stalls).
    streamed: AtomicU64,
    /// The same, counted for the whole client (every connection to every server).
    received: Arc<AtomicU64>,
    /// The largest frame the server may send (our SETTINGS_MAX_FRAME_SIZE).
    frame: u32,
    born: Instant,
    /// Acknowledgements queued for the writer, not yet taken by it (at most [`CONTROL_QUEUED`]).
    control: AtomicUsize,
    /// Permits still to be forgotten as streams end: the server lowered its SETTINGS_MAX_CONCURRENT_STREAMS
    /// below the streams open then (a permit in use cannot be forgotten until it is given back).
    owed: AtomicUsize,
}

/// A stream, as its requester and the connection share it.
struct Want {
    id: AtomicU32,
    cancelled: AtomicBool,
    /// Bumped by every head and body byte: what the requester's stall timer watches.
    progress: AtomicU64,
    /// The index the reply must be of ([`Ask::index_id`]).
    index_id: Option<Arc<str>>,
}

/// A stream's state in the reader.
struct Slot {
    want: Arc<Want>,
    expect: u64,
    range_from: u64,
    /// Taken when the stream ends.
    target: Option<Target>,
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
    Request {
        block: Vec<u8>,
        slot: Slot,
    },
    Frame(Vec<u8>),
    /// An acknowledgement of the server's PING or SETTINGS, counted in [`Shared::control`].
    Control(Vec<u8>),
}

impl Wire {
    /// Speaks HTTP/2 over `io` (a connection to `base_url`'s server, TCP or TLS): sends the preface and
    /// SETTINGS (frames up to `max_frame`), and reads until the connection ends, small reads `inbox` bytes
    /// at a time ([`INBOX`] for a socket; 0 for TLS, whose stream stages its records itself). `keep`: the
    /// keepalive ([`KeepAlive`]), if any. Every byte of a response is counted in `received` as it comes.
    pub fn start<S>(
        io: S,
        base_url: &str,
        (max_frame, inbox): (u32, usize),
        keep: Option<KeepAlive>,
        received: Arc<AtomicU64>,
    ) -> Arc<Wire>
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (read, write) = tokio::io::split(io);
        let shared = Arc::new(Shared {
            server: base_url.to_owned(),
            streams: Mutex::new(HashMap::new()),
            ended: AtomicBool::new(false),
            going_away: AtomicBool::new(false),
            answered: AtomicBool::new(false),
            permits: Arc::new(Semaphore::new(INITIAL_STREAMS)),
            peer_max_frame: AtomicU32::new(frames::DEFAULT_MAX_FRAME),
            last_heard: AtomicU64::new(0),
            streamed: AtomicU64::new(0),
            received,
            frame: max_frame.clamp(frames::DEFAULT_MAX_FRAME, frames::MAX_FRAME_LIMIT),
            born: Instant::now(),
            control: AtomicUsize::new(0),
            owed: AtomicUsize::new(0),
        });
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
        let reading = Reading::new(shared.clone(), out.clone(), reader);
        let reader = tokio::spawn(reading.run(Buffered::new(read, inbox)));
        let mut tasks = vec![writer, reader];
        if let Some(keep) = keep {
            tasks.push(tokio::spawn(keep_alive(shared.clone(), out.clone(), keep)));
        }
        Arc::new(Wire { shared, out, tasks })
    }

    /// Whether a new request may start here.
    pub fn usable(&self) -> bool {
        !self.shared.ended.load(Ordering::Acquire) && !self.shared.going_away.load(Ordering::Acquire)
    }

    /// GETs `ask`, its body into `target`; gives up after `stall` without a byte of it or of any other
    /// stream of the connection (the stream is then reset, and the connection too if nothing at all came
    /// on it meanwhile).
    pub async fn get(&self, ask: Ask<'_>, target: Target, stall: Duration) -> Result<Reply, ClientError> {
        let stalled = || ClientError::Stalled { server: self.shared.server.clone(), after: stall };
        let permit = tokio::time::timeout(stall, self.shared.permit())
            .await
            .map_err(|_| stalled())?
            .map_err(|_| self.shared.error("the connection has ended"))?;
        let want = Arc::new(Want {
            id: AtomicU32::new(0),
            cancelled: AtomicBool::new(false),
            progress: AtomicU64::new(0),
            index_id: ask.index_id.clone(),
        });
        let (done, mut answer) = oneshot::channel();
        let slot = Slot {
            want: want.clone(),
            expect: ask.expect,
            range_from: ask.range_from,
            target: Some(target),
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
        self.out.send(Out::Request { block, slot }).map_err(|_| self.shared.error("the connection has ended"))?;
        let mut cancel = Cancel { want: &want, shared: &self.shared, out: &self.out, armed: true };
        let (mut seen, mut others) = (0, self.shared.streamed.load(Ordering::Acquire));
        // When this stream's last byte came, and the connection's count of bytes then.
        let mut own = (Instant::now(), others);
        loop {
            match tokio::time::timeout(stall, &mut answer).await {
                Ok(Ok(reply)) => {
                    cancel.armed = false;
                    return reply;
                }
                Ok(Err(_)) => {
                    cancel.armed = false;
                    return Err(self.shared.error("the connection ended under the request"));
                }
                Err(_) => {
                    let now = want.progress.load(Ordering::Acquire);
                    let streamed = self.shared.streamed.load(Ordering::Acquire);
                    if now != seen {
                        (seen, others, own) = (now, streamed, (Instant::now(), streamed));
                        continue;
                    }
                    let moved = std::mem::replace(&mut others, streamed) != streamed;
                    if moved && self.waits_its_turn(streamed - own.1) && own.0.elapsed() < stall * QUEUED_STALLS {
                        continue;
                    }
                    // Heard after `millis` was read, by the reader: not a moment ago, nothing to wrap.
                    let quiet = self.shared.millis().saturating_sub(self.shared.last_heard.load(Ordering::Acquire));
                    if Duration::from_millis(quiet) >= stall {
                        // Nothing at all came on the connection: it is taken as dead.
                        self.shared.ended.store(true, Ordering::Release);
                    }
                    return Err(stalled());
                }
            }
        }
    }

    /// Whether a stream without a byte of its own while the connection's other streams received `since`
    /// bytes waits its turn (the server sends its streams' frames in turn: on a narrow link a round of
    /// them takes seconds, and asking again would put the same bytes on the same link twice), rather
    /// than being passed over (its body stuck at the server while the others flow: given up, and asked
    /// of a server again). Passed over once the others got two rounds of frames of every stream in flight
    /// without one of its own.
    fn waits_its_turn(&self, since: u64) -> bool {
        let streams = self.shared.streams.lock().unwrap().len() as u64;
        since < streams.max(1) * u64::from(self.shared.frame) * 2
    }

    fn request_block(&self, ask: &Ask<'_>) -> Vec<u8> {
        let server = &self.shared.server;
        let (https, authority) = match server.split_once("://") {
            Some((scheme, rest)) => (scheme == "https", rest.trim_end_matches('/')),
            None => (false, server.as_str()),
        };
        frames::request_block(https, authority, ask.path_and_query, ask.fields)
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

/// When an idle connection is checked: a PING after `every` without a byte from the server, and the
/// connection ended if nothing (its ACK, or any other byte) comes within `wait` of it.
#[derive(Debug, Clone, Copy)]
pub struct KeepAlive {
    pub every: Duration,
    pub wait: Duration,
}

/// Sends a PING whenever the connection has been quiet for `keep.every`, and ends it when nothing comes
/// back within `keep.wait`: its streams fail (and are retried elsewhere), and the next request makes
/// another connection.
async fn keep_alive(shared: Arc<Shared>, out: mpsc::UnboundedSender<Out>, keep: KeepAlive) {
    let every = keep.every.as_millis() as u64;
    loop {
        let last = shared.last_heard.load(Ordering::Acquire);
        let quiet = shared.millis().saturating_sub(last);
        if quiet < every {
            tokio::time::sleep(Duration::from_millis(every - quiet)).await;
            continue;
        }
        if shared.ended.load(Ordering::Acquire) || out.send(Out::Frame(frames::ping(*b"batchfs!"))).is_err() {
            return;
        }
        tokio::time::sleep(keep.wait).await;
        if shared.last_heard.load(Ordering::Acquire) == last {
            let quiet = Duration::from_millis(shared.millis().saturating_sub(last));
            tracing::warn!(server = %shared.server, ?quiet, "ending a connection that answered no PING");
            shared.end(&shared.error(format!("no answer to a PING within {:?}", keep.wait)));
            return;
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
        // Sequentially consistent, as the writer's store of the id and load of `cancelled`: each side then
        // sees the other's store (with release and acquire both could miss it, the slot then inserted and
        // its HEADERS sent with nobody to reset it).
        self.want.cancelled.store(true, Ordering::SeqCst);
        let id = self.want.id.load(Ordering::SeqCst);
        if id != 0 {
            // Dropped here, or by the reader (which checks `cancelled` under this lock) if it holds it.
            drop(self.shared.streams.lock().unwrap().remove(&id));
            let _ = self.out.send(Out::Frame(frames::rst_stream(id, code::CANCEL)));
        }
    }
}

impl Shared {
    /// A permit for a stream, once those [`Shared::owed`] are paid (each forgotten as it is given back).
    async fn permit(&self) -> Result<OwnedSemaphorePermit, tokio::sync::AcquireError> {
        loop {
            let permit = self.permits.clone().acquire_owned().await?;
            let paid = self.owed.fetch_update(Ordering::AcqRel, Ordering::Acquire, |owed| owed.checked_sub(1));
            match paid {
                Ok(_) => permit.forget(),
                Err(_) => return Ok(permit),
            }
        }
    }

    fn millis(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    /// `n` more of a stream's head or body came.
    fn progressed(&self, want: &Want, n: u64) {
        want.progress.fetch_add(n, Ordering::Release);
        self.streamed.fetch_add(n, Ordering::Release);
        self.received.fetch_add(n, Ordering::Relaxed);
    }

    /// The server's bytes came just now.
    fn heard(&self) {
        self.last_heard.store(self.millis(), Ordering::Release);
    }

    fn error(&self, what: impl Into<String>) -> ClientError {
        ClientError::Unreachable { server: self.server.clone(), cause: Arc::new(std::io::Error::other(what.into())) }
    }

    /// A request the server never took, for `what`: its stream never began, or began past a GOAWAY's
    /// last stream. Asked again on another connection, it fails nothing of the server's ([`not_sent`]),
    /// where the connection has answered a stream: one that closes every connection before it answers
    /// any (a server draining, a proxy refusing) is failing, and counted so.
    pub(super) fn not_sent(&self, what: impl Into<String>) -> ClientError {
        if !self.answered.load(Ordering::Acquire) {
            return self.error(what);
        }
        ClientError::Unreachable { server: self.server.clone(), cause: Arc::new(NotSent(what.into())) }
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
                Out::Control(f) => {
                    shared.control.fetch_sub(1, Ordering::AcqRel);
                    buf.extend_from_slice(&f);
                }
                Out::Request { block, slot } => {
                    if shared.ended.load(Ordering::Acquire) {
                        let _ = slot.done.send(Err(shared.not_sent("the connection has ended")));
                    } else if shared.going_away.load(Ordering::Acquire) {
                        // After a GOAWAY the server takes no new stream: this one is retried elsewhere.
                        let _ = slot.done.send(Err(shared.not_sent("the server is closing the connection")));
                    } else if next_id > frames::MAX_WINDOW {
                        shared.going_away.store(true, Ordering::Release);
                        let _ = slot.done.send(Err(shared.not_sent("the connection's stream ids ran out")));
                    } else {
                        let id = next_id;
                        next_id += 2;
                        slot.want.id.store(id, Ordering::SeqCst);
                        // Looked at again under the lock a GOAWAY's sweep of the streams past its last takes
                        // (after it marks the connection going away): a stream put in after the sweep got
                        // an id the server ignores, and waited for a reply that never came.
                        let refused = {
                            let mut streams = shared.streams.lock().unwrap();
                            if slot.want.cancelled.load(Ordering::SeqCst) {
                                None
                            } else if shared.going_away.load(Ordering::Acquire) || shared.ended.load(Ordering::Acquire)
                            {
                                Some(Some(slot))
                            } else {
                                streams.insert(id, slot);
                                Some(None)
                            }
                        };
                        match refused {
                            Some(None) => {
                                let max = shared.peer_max_frame.load(Ordering::Acquire);
                                buf.extend_from_slice(&frames::headers(id, &block, max, true));
                            }
                            Some(Some(slot)) => {
                                let _ = slot.done.send(Err(shared.not_sent("the server is closing the connection")));
                            }
                            None => {}
                        }
                    }
                }
            }
            next = if buf.len() < (256 << 10) { rx.try_recv().ok() } else { None };
        }
    }
}

/// Why a request was never taken by its server (see [`Shared::not_sent`]).
#[derive(Debug)]
struct NotSent(String);

impl std::fmt::Display for NotSent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotSent {}

/// Whether `e` failed a request its server never took (a connection closing or ended before the
/// request's stream began, or a stream past a GOAWAY's last): no failure of the server's, which an idle
/// connection closed by its server (`idle_timeout`) raced with a new request was taken for.
pub fn not_sent(e: &ClientError) -> bool {
    matches!(e, ClientError::Unreachable { cause, .. } if cause.downcast_ref::<NotSent>().is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffers::Filling;
    use proptest::prelude::*;
    use tokio::io::AsyncReadExt;

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
    /// bytes (as the flow-control windows let it), `/status/N` with status N and a JSON error,
    /// `/late/MS/LEN/SEED` as `/LEN/SEED` after MS milliseconds, `/trickle/LEN/PIECE/MS` with LEN bytes in
    /// pieces of PIECE every MS milliseconds, and `/silent` never.
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
                            if parts[0] == "late" {
                                tokio::time::sleep(Duration::from_millis(parts[1].parse().unwrap())).await;
                            }
                            let parts = if parts[0] == "late" { &parts[2..] } else { &parts[..] };
                            if parts[0] == "trickle" {
                                let n: Vec<usize> = parts[1..].iter().map(|p| p.parse().unwrap()).collect();
                                let response = http::Response::builder().status(200).header("content-length", n[0]);
                                let mut s = respond.send_response(response.body(()).unwrap(), false).unwrap();
                                for at in (0..n[0]).step_by(n[1]) {
                                    tokio::time::sleep(Duration::from_millis(n[2] as u64)).await;
                                    let piece = bytes::Bytes::from(vec![7u8; n[1].min(n[0] - at)]);
                                    if s.send_data(piece, at + n[1] >= n[0]).is_err() {
                                        return;
                                    }
                                }
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

    /// A connection taking frames of up to 1 MiB (the mount's default `frame_size`): a frame bound for a
    /// fresh memory file is then read in several pieces ([`reading::PIECE_BYTES`]).
    async fn wire_to(server: &str) -> Arc<Wire> {
        let socket = tokio::net::TcpStream::connect(server.trim_start_matches("http://")).await.unwrap();
        Wire::start(socket, server, (1 << 20, INBOX), None, Default::default())
    }

    fn sink(len: usize, into_file: bool) -> Sink {
        if into_file {
            Sink::File(crate::buffers::MemoryFile::new(crate::sys::memfd("batchfs-test").unwrap()))
        } else {
            Sink::Buffer(Filling::new(Vec::new(), (len as u64, 0), None, || {}))
        }
    }

    /// A memory file filled before with other bytes (more of them or fewer), to be filled again with a
    /// body of `len` bytes; a memfd where the huge-page tmpfs is not to be had (not root), which cannot
    /// be filled again: a buffer then.
    fn recycled_sink(len: usize) -> Sink {
        if crate::sys::use_huge_pages().is_err() {
            return sink(len, false);
        }
        let old = len / 2 + (len % 3) * len;
        let f = crate::sys::memory_file("batchfs-test", old as u64).unwrap();
        std::io::Write::write_all(&mut &f, &vec![0xa5; old]).unwrap();
        let f = crate::sys::seal(f).unwrap();
        let sink = Sink::recycled(f, len as u64).unwrap();
        assert!(matches!(&sink, Sink::File(m) if m.is_recycled() || len == 0));
        sink
    }

    /// What a success delivered, with the body's CRC32C checked against its bytes.
    fn bytes_of(got: Got) -> Vec<u8> {
        let Got::Body(body) = got else { panic!("a body was asked for") };
        let crc = body.crc32c;
        let bytes = match body.sink {
            Sink::Buffer(f) => f.finish().to_vec(),
            Sink::File(m) => {
                let mut file = m.finish().unwrap();
                let mut all = Vec::new();
                std::io::Seek::rewind(&mut file).unwrap();
                std::io::Read::read_to_end(&mut file, &mut all).unwrap();
                all
            }
        };
        assert_eq!(crc, crc32c::crc32c(&bytes));
        bytes
    }

    async fn get(wire: &Wire, path: &str, expect: usize, into_file: bool) -> Result<Reply, ClientError> {
        get_into(wire, path, expect, sink(expect, into_file)).await
    }

    async fn get_into(wire: &Wire, path: &str, expect: usize, sink: Sink) -> Result<Reply, ClientError> {
        let ask = Ask {
            path_and_query: path,
            fields: &[("x-test", "1")],
            expect: expect as u64,
            range_from: 0,
            index_id: None,
        };
        wire.get(ask, Target::Sink(sink), Duration::from_secs(10)).await
    }

    /// A small reply of at most `most` bytes, gathered whole.
    async fn get_whole(wire: &Wire, path: &str, most: usize) -> Result<Reply, ClientError> {
        let ask = Ask { path_and_query: path, fields: &[], expect: most as u64, range_from: 0, index_id: None };
        wire.get(ask, Target::Whole(Whole::default()), Duration::from_secs(10)).await
    }

    /// `path`'s body of `len` bytes into a buffer, given up after `stall` without a byte.
    async fn get_stalling(wire: &Wire, path: &str, len: usize, stall: Duration) -> Result<Reply, ClientError> {
        get_stalling_into(wire, path, len, stall, false).await
    }

    /// [`get_stalling`] into a buffer, or a fresh memory file.
    async fn get_stalling_into(
        wire: &Wire,
        path: &str,
        len: usize,
        stall: Duration,
        into_file: bool,
    ) -> Result<Reply, ClientError> {
        let ask = Ask { path_and_query: path, fields: &[], expect: len as u64, range_from: 0, index_id: None };
        wire.get(ask, Target::Sink(sink(len, into_file)), stall).await
    }

    /// A connection taking frames of up to 16 KiB: two rounds of frames of two streams are 64 KiB.
    async fn small_frames_to(server: &str) -> Arc<Wire> {
        let socket = tokio::net::TcpStream::connect(server.trim_start_matches("http://")).await.unwrap();
        Wire::start(socket, server, (16 << 10, INBOX), None, Default::default())
    }

    /// A stream whose first byte comes after twice `stall`, while another stream of its connection
    /// receives a little (fewer bytes than two rounds of frames), waits its turn: not given up as stalled
    /// (it was, at `stall`, and asked again over the same link).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_waiting_its_turn_behind_one_that_receives_is_not_stalled() {
        let server = reference_server(16 << 10).await;
        let wire = small_frames_to(&server).await;
        let stall = Duration::from_millis(300);
        let flowing = get_stalling(&wire, "/trickle/40000/1000/50", 40_000, stall);
        let waiting = get_stalling(&wire, "/late/700/5000/3", 5000, stall);
        let (flowing, waiting) = tokio::join!(flowing, waiting);
        assert_eq!(flowing.unwrap().status, 200);
        let reply = waiting.expect("it waited its turn");
        assert_eq!(bytes_of(reply.body.unwrap()), body_of(5000, 3));
    }

    /// A stream that gets nothing while another of its connection receives two rounds of frames of
    /// every stream is passed over, its body stuck at the server: given up at the next `stall`, not
    /// after [`QUEUED_STALLS`] of them; whether the others' bodies go into buffers or fresh memory files
    /// (whose reads counted a byte each: given up after six stalls).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_passed_over_while_another_receives_is_given_up() {
        for into_file in [false, true] {
            let server = reference_server(16 << 10).await;
            let wire = small_frames_to(&server).await;
            let stall = Duration::from_millis(300);
            let flowing = tokio::spawn({
                let wire = wire.clone();
                let path = "/trickle/2000000/16384/20";
                async move { get_stalling_into(&wire, path, 2_000_000, stall, into_file).await.map(|r| r.status) }
            });
            let started = Instant::now();
            let silent = get_stalling(&wire, "/silent", 10, stall).await;
            assert!(matches!(silent, Err(ClientError::Stalled { .. })), "{silent:?}");
            assert!(started.elapsed() < stall * 4, "into a file: {into_file}; given up after {:?}", started.elapsed());
            flowing.abort();
        }
    }

    /// A raw server on loopback, running `serve` on its one connection (after the client's preface), and
    /// a connection to it.
    async fn raw_server<F, Fut>(serve: F) -> Arc<Wire>
    where
        F: FnOnce(tokio::net::TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut preface = [0u8; 24];
            socket.read_exact(&mut preface).await.unwrap();
            serve(socket).await;
        });
        wire_to(&server).await
    }

    /// A server that sends PINGs without end and reads nothing (their acknowledgements pile up behind a
    /// full socket) is told to calm down and its connection ended: each acknowledgement queued was a
    /// frame in our memory (2.5 GB in 12 s).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_flooding_pings_it_never_reads_the_answers_of_is_ended() {
        let wire = raw_server(|mut socket| async move {
            let pings: Vec<u8> = (0..4096).flat_map(|_| frames::frame(frames::kind::PING, 0, 0, &[7; 8])).collect();
            while socket.write_all(&pings).await.is_ok() {}
        })
        .await;
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            while wire.usable() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(ended.is_ok(), "the connection is still in use");
        let err = get(&wire, "/1/1", 1, false).await.unwrap_err();
        assert!(err.to_string().contains("has ended"), "{err}");
        assert!(wire.shared.control.load(Ordering::Acquire) <= CONTROL_QUEUED + 1);
    }

    /// The server lowers SETTINGS_MAX_CONCURRENT_STREAMS below the streams open then: once those end, no
    /// more than it allows are open at once (the permits in use then were not forgotten: 20 streams
    /// opened against a limit of 4, each refused by a real server). Raised again, it allows more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streams_follow_a_limit_lowered_while_more_are_open() {
        let (most_tx, most_rx) = oneshot::channel();
        let wire = raw_server(|mut socket| async move {
            let mut open = Vec::new();
            let (mut answered, mut most) = (0, 0);
            loop {
                // Every stream opened while none came for 300 ms (or 20 are open), then all answered.
                let mut head = [0u8; 9];
                match tokio::time::timeout(Duration::from_millis(300), socket.read_exact(&mut head)).await {
                    Ok(Ok(_)) => {
                        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                        let mut payload = vec![0; len];
                        socket.read_exact(&mut payload).await.unwrap();
                        if head[3] == frames::kind::HEADERS {
                            open.push(u32::from_be_bytes(head[5..9].try_into().unwrap()) & 0x7fff_ffff);
                        }
                        if open.len() < 20 {
                            continue;
                        }
                    }
                    Ok(Err(_)) => return,
                    Err(_) if open.is_empty() => continue,
                    Err(_) => {}
                }
                if answered == 0 {
                    socket.write_all(&frames::settings(&[(setting::MAX_CONCURRENT_STREAMS, 4)])).await.unwrap();
                } else {
                    most = most.max(open.len());
                }
                for id in open.drain(..) {
                    let mut reply = frames::frame(frames::kind::HEADERS, frames::flag::END_HEADERS, id, &[0x88]);
                    reply.extend(frames::frame(frames::kind::DATA, frames::flag::END_STREAM, id, &[1]));
                    socket.write_all(&reply).await.unwrap();
                    answered += 1;
                }
                if answered == 40 {
                    let _ = most_tx.send(most);
                    let mut rest = Vec::new();
                    let _ = socket.read_to_end(&mut rest).await;
                    return;
                }
            }
        })
        .await;
        let twenty = || {
            let gets = (0..20).map(|_| {
                let wire = wire.clone();
                async move { get(&wire, "/1/1", 1, false).await.unwrap().status }
            });
            futures_util::future::join_all(gets)
        };
        // The first twenty open before the server's SETTINGS come (100 allowed until then).
        assert!(twenty().await.iter().all(|&s| s == 200));
        assert!(twenty().await.iter().all(|&s| s == 200));
        let most = tokio::time::timeout(Duration::from_secs(10), most_rx).await.unwrap().unwrap();
        assert!(most <= 4, "{most} streams open against a limit of 4");
        assert_eq!(wire.shared.owed.load(Ordering::Acquire), 0, "every permit owed was paid");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Bodies sent by the reference server, many at once on one connection, in pieces of any size,
        /// arrive whole into buffers, memory files and memory files filled again, with their CRC32C.
        #[test]
        fn bodies_from_a_reference_server_arrive_whole(
            lens in proptest::collection::vec(0usize..(3 << 20), 1..12),
            piece in prop_oneof![1usize..(300 << 10), (300usize << 10)..(1200 << 10)],
        ) {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            rt.block_on(async {
                let server = reference_server(piece).await;
                let wire = wire_to(&server).await;
                let gets = lens.iter().enumerate().map(|(i, &len)| {
                    let wire = wire.clone();
                    async move {
                        let path = format!("/{len}/{i}");
                        // Into a buffer, a memory file, one filled again, or gathered whole as a small reply is.
                        let reply = match i % 4 {
                            3 => get_into(&wire, &path, len, recycled_sink(len)).await.unwrap(),
                            2 => get_whole(&wire, &path, len).await.unwrap(),
                            k => get(&wire, &path, len, k == 0).await.unwrap(),
                        };
                        assert_eq!(reply.status, 200);
                        let got = match reply.body.unwrap() {
                            Got::Whole(whole) => whole.bytes,
                            body => bytes_of(body),
                        };
                        assert!(got == body_of(len, i as u64), "body {i} of {len} bytes");
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
        {
            let wire = wire_to(&server).await;
            let len = (CONNECTION_WINDOW as usize) / 2 + (STREAM_WINDOW as usize) + 12_345;
            let (one, two) = (format!("/{len}/1"), format!("/{len}/2"));
            let (a, b) = tokio::join!(get(&wire, &one, len, true), get(&wire, &two, len, false));
            for (reply, seed) in [(a, 1), (b, 2)] {
                assert!(bytes_of(reply.unwrap().body.unwrap()) == body_of(len, seed));
            }
        }
    }

    /// A body longer than the memory file filled again that it is received into fails its own stream,
    /// and the connection serves the next request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_past_its_memory_file_fails_its_stream_only() {
        if crate::sys::use_huge_pages().is_err() {
            return;
        }
        let wire = wire_to(&reference_server(1 << 20).await).await;
        let len = 3 << 20;
        let err = get_into(&wire, &format!("/{len}/1"), len, recycled_sink(len - 1000)).await.unwrap_err();
        let past = |m: &str| m.contains("ran past its memory file");
        assert!(matches!(&err, ClientError::Malformed { message, .. } if past(message)), "{err}");
        let reply = get(&wire, &format!("/{len}/2"), len, true).await.unwrap();
        assert!(bytes_of(reply.body.unwrap()) == body_of(len, 2));
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
        // A small reply past the most it may hold, likewise.
        let err = get_whole(&wire, "/50000/1", 1000).await.unwrap_err();
        let bounded = |m: &str| m.contains("announced 50000") && m.contains("the most a reply may hold");
        assert!(matches!(&err, ClientError::Malformed { message, .. } if bounded(message)), "{err}");
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
        // The connection's start (SETTINGS and their acknowledgement) over before the silent request: on a
        // loaded machine its frames came within the stall, and the connection was rightly kept.
        let reply = get(&wire, "/1000/1", 1000, false).await.unwrap();
        assert!(bytes_of(reply.body.unwrap()) == body_of(1000, 1));
        let ask = Ask { path_and_query: "/silent", fields: &[], expect: 10, range_from: 0, index_id: None };
        let err = wire.get(ask, Target::Sink(sink(10, true)), Duration::from_millis(300)).await.unwrap_err();
        assert!(matches!(err, ClientError::Stalled { .. }), "{err}");
        assert!(!wire.usable());
    }

    /// An idle connection is PINGed: one whose server answers stays in use; one whose server has gone
    /// silent (a dead peer, a path that dropped the connection) is ended, and the stream waiting on it
    /// fails with the reason, long before its own stall timeout.
    #[tokio::test]
    async fn an_idle_connection_is_pinged_and_a_silent_one_ended() {
        let keep = KeepAlive { every: Duration::from_millis(100), wait: Duration::from_millis(200) };
        let server = reference_server(4096).await;
        let socket = tokio::net::TcpStream::connect(server.trim_start_matches("http://")).await.unwrap();
        let wire = Wire::start(socket, &server, (128 << 10, INBOX), Some(keep), Default::default());
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(wire.usable(), "a connection whose server answers its PINGs was ended");
        let reply = get(&wire, "/1000/1", 1000, false).await.unwrap();
        assert!(bytes_of(reply.body.unwrap()) == body_of(1000, 1));

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent = format!("http://{}", listener.local_addr().unwrap());
        let (pings_tx, pings_rx) = oneshot::channel();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            socket.write_all(&frames::settings(&[])).await.unwrap();
            let mut all = Vec::new();
            let _ = socket.read_to_end(&mut all).await;
            let _ = pings_tx.send(all.windows(5).filter(|w| w[..4] == frames::ping(*b"batchfs!")[..4]).count());
        });
        let socket = tokio::net::TcpStream::connect(silent.trim_start_matches("http://")).await.unwrap();
        let wire = Wire::start(socket, &silent, (128 << 10, INBOX), Some(keep), Default::default());
        let started = Instant::now();
        let err = get(&wire, "/1/1", 1, false).await.unwrap_err();
        assert!(err.to_string().contains("no answer to a PING within 200ms"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(3), "ended after {:?}", started.elapsed());
        assert!(!wire.usable());
        drop(wire);
        let pings = tokio::time::timeout(Duration::from_secs(5), pings_rx).await.unwrap().unwrap();
        assert!(pings >= 1, "no PING was sent");
    }

    /// A body whose one frame trickles in for longer than the keepalive's interval and wait together keeps
    /// its connection: bytes within a frame count as the server heard from, not only whole frames.
    #[tokio::test]
    async fn a_frame_that_trickles_in_keeps_its_connection() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = format!("http://{}", listener.local_addr().unwrap());
        let len = 128 << 10;
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            socket.write_all(&frames::settings(&[])).await.unwrap();
            let mut request = [0u8; 256];
            let _ = socket.read(&mut request).await;
            // `:status: 200` (HPACK's static entry 8), then one DATA frame of the whole body, sent in 16
            // pieces over about 1.2 s; PINGs are left unanswered.
            let head = frames::frame(frames::kind::HEADERS, frames::flag::END_HEADERS, 1, &[0x88]);
            let body = body_of(len, 5);
            let mut data = frames::frame(frames::kind::DATA, frames::flag::END_STREAM, 1, &body);
            socket.write_all(&head).await.unwrap();
            for piece in data.chunks_mut(len / 16 + 1) {
                tokio::time::sleep(Duration::from_millis(75)).await;
                socket.write_all(piece).await.unwrap();
            }
            let mut rest = Vec::new();
            let _ = socket.read_to_end(&mut rest).await;
        });
        let keep = KeepAlive { every: Duration::from_millis(100), wait: Duration::from_millis(200) };
        let socket = tokio::net::TcpStream::connect(server.trim_start_matches("http://")).await.unwrap();
        let wire = Wire::start(socket, &server, (128 << 10, INBOX), Some(keep), Default::default());
        let reply = get(&wire, "/trickle", len, false).await.unwrap();
        assert!(bytes_of(reply.body.unwrap()) == body_of(len, 5));
        assert!(wire.usable());
    }

    /// A GOAWAY after the connection served a stream (a server closing an idle connection): the requests
    /// it did not take are never-sent ones, asked again elsewhere with no failure of the server's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_a_serving_connection_closed_under_were_never_sent() {
        let wire = raw_server(|mut socket| async move {
            socket.write_all(&frames::settings(&[])).await.unwrap();
            loop {
                let mut head = [0u8; 9];
                socket.read_exact(&mut head).await.unwrap();
                let mut payload = vec![0; u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize];
                socket.read_exact(&mut payload).await.unwrap();
                if head[3] == frames::kind::HEADERS {
                    let end = frames::flag::END_HEADERS | frames::flag::END_STREAM;
                    let mut reply = frames::frame(frames::kind::HEADERS, end, 1, &[0x88]);
                    reply.extend_from_slice(&frames::goaway(1, frames::code::NO_ERROR));
                    socket.write_all(&reply).await.unwrap();
                    break;
                }
            }
            let mut rest = Vec::new();
            let _ = socket.read_to_end(&mut rest).await;
        })
        .await;
        assert!(get_whole(&wire, "/a", 100).await.is_ok());
        let deadline = Instant::now() + Duration::from_secs(10);
        while wire.usable() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let err = get_whole(&wire, "/b", 100).await.unwrap_err();
        assert!(not_sent(&err), "{err}");
    }

    /// A GOAWAY fails the streams the server will not answer, with its reason, and no new stream starts on
    /// the connection (the client makes another). On a connection that served none (a server draining, a
    /// proxy refusing every connection) that is the server failing: counted so, not taken as never sent.
    #[tokio::test]
    async fn a_goaway_fails_the_streams_past_it_and_stops_new_ones() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            socket.write_all(&frames::settings(&[])).await.unwrap();
            let mut first = [0u8; 64];
            let _ = socket.read(&mut first).await;
            let mut goaway = frames::goaway(0, frames::code::NO_ERROR);
            goaway.extend_from_slice(&frames::frame(frames::kind::PING, 0, 0, &[0; 8]));
            socket.write_all(&goaway).await.unwrap();
            let mut rest = Vec::new();
            let _ = socket.read_to_end(&mut rest).await;
        });
        let wire = wire_to(&server).await;
        let err = get(&wire, "/1/1", 1, true).await.unwrap_err();
        assert!(err.to_string().contains("closing the connection (NO_ERROR)"), "{err}");
        assert!(!not_sent(&err), "a connection that served nothing: the server failing");
        assert!(!wire.usable());
        let err = get(&wire, "/1/1", 1, false).await.unwrap_err();
        assert!(err.to_string().contains("closing the connection") && !not_sent(&err), "{err}");
    }

    /// A peer that breaks HTTP/2 ends the connection with an error naming what it broke, and every stream
    /// on it with it; nothing hangs.
    #[tokio::test]
    async fn a_peer_that_breaks_the_protocol_ends_the_connection() {
        for garbage in [
            frames::frame(frames::kind::PUSH_PROMISE, frames::flag::END_HEADERS, 1, &[0, 0, 0, 2]),
            frames::frame(frames::kind::DATA, 0, 1, &vec![0; (1 << 20) + 1]),
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
