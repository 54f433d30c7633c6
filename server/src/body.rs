//! Response bodies. A batch (or source file) body is streamed straight from the mapped shards in
//! chunks that share the mapping (`Bytes::from_owner`, no copy), with one rule: **a tokio worker never
//! faults on storage.** Before a chunk is handed to hyper, `mincore(2)` says whether its pages are
//! resident; if not, the pages are touched on the blocking pool, holding a permit of the storage
//! semaphore, which bounds concurrent storage reads (LMDBIO's staggering) for the whole server.
//!
//! Shards that are not mapped (see `storage.rs`) are read with positioned reads on the blocking pool,
//! under the same semaphore; consecutive segments (the small files of a file tree, and the framing
//! between them) are read together, up to `chunk_size` per chunk, so a batch of small files costs a few
//! blocking tasks rather than one per file.

use crate::metrics::Metrics;
use crate::storage::{Shard, Storage};
use batchfs::encode::Segment;
use batchfs::mmap::MappedFile;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::Semaphore;

/// A slice of a mapped shard, owned (keeps the mapping alive).
struct MapSlice {
    map: Arc<MappedFile>,
    start: usize,
    end: usize,
}

impl AsRef<[u8]> for MapSlice {
    fn as_ref(&self) -> &[u8] {
        &self.map.bytes()[self.start..self.end]
    }
}

/// Touches every page of `[offset, offset+len)` so it is resident afterwards.
pub(crate) fn fault_in(map: &MappedFile, offset: u64, len: u64) {
    let bytes = &map.bytes()[offset as usize..(offset + len) as usize];
    let mut sum = 0u8;
    for page in bytes.chunks(4096) {
        sum = sum.wrapping_add(page[0]);
    }
    std::hint::black_box(sum);
}

/// Shared by every streaming body of a server.
pub struct StreamContext {
    pub storage: Arc<Semaphore>,
    pub metrics: Arc<Metrics>,
    /// Largest chunk handed to hyper at once.
    pub chunk_size: u64,
}

type Pending = Pin<Box<dyn Future<Output = Result<Bytes, std::io::Error>> + Send>>;

/// A body streamed from shard segments.
pub struct SegmentBody {
    ctx: Arc<StreamContext>,
    storage: Arc<Storage>,
    segments: std::vec::IntoIter<Segment>,
    /// The data segment being sent: (shard, next offset, bytes left).
    current: Option<(u32, u64, u64)>,
    pending: Option<Pending>,
    remaining: u64,
}

impl SegmentBody {
    pub fn new(ctx: Arc<StreamContext>, storage: Arc<Storage>, segments: Vec<Segment>) -> Self {
        let remaining = segments.iter().map(Segment::len).sum();
        ctx.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        SegmentBody { ctx, storage, segments: segments.into_iter(), current: None, pending: None, remaining }
    }

    fn next_chunk(&mut self) -> Option<Result<Bytes, Pending>> {
        loop {
            if let Some((shard, offset, left)) = self.current {
                let map = match self.storage.shard(shard) {
                    Shard::Mapped(map) => map.clone(),
                    Shard::Open { .. } | Shard::Closed { .. } => return Some(Err(self.read_files())),
                };
                let n = left.min(self.ctx.chunk_size);
                self.current = (left > n).then_some((shard, offset + n, left - n));
                let slice = MapSlice { map: map.clone(), start: offset as usize, end: (offset + n) as usize };
                if map.is_resident(offset, n) {
                    return Some(Ok(Bytes::from_owner(slice)));
                }
                let ctx = self.ctx.clone();
                return Some(Err(Box::pin(async move {
                    let _permit = ctx.storage.clone().acquire_owned().await.map_err(std::io::Error::other)?;
                    ctx.metrics.storage_reads.fetch_add(1, Ordering::Relaxed);
                    tokio::task::spawn_blocking(move || {
                        fault_in(&slice.map, offset, n);
                        Bytes::from_owner(slice)
                    })
                    .await
                    .map_err(std::io::Error::other)
                })));
            }
            match self.segments.next()? {
                Segment::Inline(bytes) if bytes.is_empty() => continue,
                Segment::Inline(bytes) => return Some(Ok(Bytes::from(bytes))),
                Segment::Data { shard, offset, len } => self.current = Some((shard, offset, len)),
            }
        }
    }

    /// The next chunk from unmapped shards, starting at `current`: that segment and the ones after it
    /// while they are unmapped data or framing, up to `chunk_size` bytes, read in one blocking task.
    fn read_files(&mut self) -> Pending {
        enum Piece {
            Inline(Vec<u8>),
            Data(u32, u64, u64),
        }
        let chunk = self.ctx.chunk_size.max(1);
        let mut pieces = Vec::new();
        let mut total = 0;
        while total < chunk {
            if let Some((shard, offset, left)) = self.current {
                let n = left.min(chunk - total);
                self.current = (left > n).then_some((shard, offset + n, left - n));
                pieces.push(Piece::Data(shard, offset, n));
                total += n;
                continue;
            }
            match self.segments.as_slice().first() {
                Some(Segment::Inline(bytes)) => total += bytes.len() as u64,
                Some(&Segment::Data { shard, offset, len })
                    if !matches!(self.storage.shard(shard), Shard::Mapped(_)) =>
                {
                    self.current = Some((shard, offset, len));
                }
                _ => break,
            }
            if let Some(Segment::Inline(bytes)) = self.segments.next() {
                pieces.push(Piece::Inline(bytes));
            }
        }
        let (ctx, storage) = (self.ctx.clone(), self.storage.clone());
        Box::pin(async move {
            let _permit = ctx.storage.clone().acquire_owned().await.map_err(std::io::Error::other)?;
            ctx.metrics.storage_reads.fetch_add(1, Ordering::Relaxed);
            tokio::task::spawn_blocking(move || {
                let mut out = Vec::with_capacity(total as usize);
                for piece in pieces {
                    match piece {
                        Piece::Inline(bytes) => out.extend_from_slice(&bytes),
                        Piece::Data(shard, offset, len) => storage.read(shard, offset, len, &mut out)?,
                    }
                }
                Ok(Bytes::from(out))
            })
            .await
            .map_err(std::io::Error::other)?
        })
    }

    fn emit(&mut self, bytes: Bytes) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.remaining -= bytes.len() as u64;
        self.ctx.metrics.response_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Poll::Ready(Some(Ok(Frame::data(bytes))))
    }
}

impl Drop for SegmentBody {
    fn drop(&mut self) {
        self.ctx.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl http_body::Body for SegmentBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Some(pending) = &mut this.pending {
            let result = std::task::ready!(pending.as_mut().poll(cx));
            this.pending = None;
            return match result {
                Ok(bytes) => this.emit(bytes),
                Err(e) => Poll::Ready(Some(Err(e))),
            };
        }
        match this.next_chunk() {
            None => Poll::Ready(None),
            Some(Ok(bytes)) => this.emit(bytes),
            Some(Err(pending)) => {
                this.pending = Some(pending);
                self.poll_frame(cx)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// Every response body of the server.
pub enum Body {
    Full(Option<Bytes>),
    Segments(SegmentBody),
}

impl Body {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        Body::Full(Some(bytes.into()))
    }

    pub fn empty() -> Self {
        Body::Full(None)
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().filter(|b| !b.is_empty()).map(|b| Ok(Frame::data(b)))),
            Body::Segments(s) => Pin::new(s).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Full(b) => b.as_ref().is_none_or(|b| b.is_empty()),
            Body::Segments(s) => s.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Body::Segments(s) => s.size_hint(),
        }
    }
}
