//! One chunk of a body read with direct I/O: its reads planned, read, and cut into frames.
//!
//! A chunk is a run of pieces: ranges of shards opened `O_DIRECT`, and framing. Each range needs the
//! aligned blocks around it; ranges of one shard whose blocks touch, or lie at most [`MERGE_GAP`] apart
//! (the members of one WebDataset sample, separated by a tar header: a JPEG and its `.cls`), are one
//! read. All reads of a chunk land in one aligned buffer from the pool and go to the device together
//! (`uring.rs`); large pieces are then sent as slices of the buffer, small ones and the framing copied
//! together into one frame.

use crate::aligned::{self, align_down, align_up, DIRECT_ALIGN};
use crate::storage::uring::{ReadOp, Ring};
use crate::storage::{DirectFd, Storage};
use bytes::Bytes;
use std::sync::Arc;

/// Blocks of one shard at most this far apart are read in one read (the gap read and dropped): one
/// read instead of two, for a few KiB more.
pub const MERGE_GAP: u64 = 16 << 10;

/// Pieces shorter than this are copied together into one frame; longer ones are sent as slices of the
/// read buffer.
const SMALL_PIECE: u64 = 32 << 10;

/// One read of a planned chunk: the aligned blocks `[start, end)` of `shard`, into the buffer at `at`.
struct Read {
    shard: u32,
    /// The descriptor read (kept open for the read where it is a copy in the disk tier).
    file: DirectFd,
    start: u64,
    end: u64,
    /// The last byte a piece needs, plus one (past it, a short read at the file's end is fine).
    need_end: u64,
    at: usize,
}

/// A piece of a chunk.
pub enum Piece {
    Inline(Vec<u8>),
    /// `len` bytes of the shard at buffer position `place`.
    Data {
        len: u64,
        place: usize,
    },
}

/// The reads of a chunk, planned as its pieces are taken, within one buffer of `room` bytes.
pub struct ChunkPlan {
    room: u64,
    used: u64,
    reads: Vec<Read>,
    pub pieces: Vec<Piece>,
    /// A range the plan refused (past its shard's indexed size): the chunk fails with it.
    error: Option<std::io::Error>,
}

impl ChunkPlan {
    pub fn new(room: u64) -> Self {
        ChunkPlan { room, used: 0, reads: Vec::new(), pieces: Vec::new(), error: None }
    }

    /// The error of a range the plan refused, if it refused one (taken: the chunk is not read).
    pub fn take_error(&mut self) -> Option<std::io::Error> {
        self.error.take()
    }

    /// Framing, sent as it is.
    pub fn inline(&mut self, bytes: Vec<u8>) {
        self.pieces.push(Piece::Inline(bytes));
    }

    /// Takes as much of `[offset, offset + len)` of direct shard `shard` as the buffer has room for, and
    /// returns how much (0: none, the chunk is full). The first range of a chunk always fits whole up to
    /// `room - 2 × DIRECT_ALIGN` bytes.
    pub fn data(&mut self, storage: &Storage, shard: u32, offset: u64, len: u64) -> u64 {
        let left = self.room - self.used;
        // The end of the last read, when this range's blocks touch it or lie close after it.
        let merge = self
            .reads
            .last()
            .filter(|r| r.shard == shard && align_down(offset) >= r.start && align_down(offset) <= r.end + MERGE_GAP);
        let merge = merge.map(|r| r.end);
        // The most of the range whose blocks fit: grown from the last read (contiguous in the buffer, it
        // may reach `end + left` of the file), or a read of its own (a block before the bytes at most,
        // and one after).
        let n = match merge {
            Some(end) => len.min((end + left).saturating_sub(offset)),
            None => len.min(left.saturating_sub(offset % DIRECT_ALIGN + DIRECT_ALIGN)),
        };
        if n == 0 || self.error.is_some() {
            return 0;
        }
        let file = match storage.direct_fd(shard, offset, n) {
            Ok(file) => file,
            // An object's copy the tier no longer holds: not taken here, read another way.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return 0,
            Err(e) => {
                self.error = Some(e);
                return 0;
            }
        };
        let end = align_up(offset + n);
        let place = match (merge.is_some(), self.reads.last_mut()) {
            (true, Some(r)) => {
                let grown = end.max(r.end);
                self.used += grown - r.end;
                (r.end, r.need_end) = (grown, r.need_end.max(offset + n));
                r.at + (offset - r.start) as usize
            }
            _ => {
                let start = align_down(offset);
                let at = self.used as usize;
                self.reads.push(Read { shard, file, start, end, need_end: offset + n, at });
                self.used += end - start;
                at + (offset - start) as usize
            }
        };
        self.pieces.push(Piece::Data { len: n, place });
        n
    }

    /// Reads the plan into a buffer of `pool` with `pread` and cuts it into frames. Blocks: call on the
    /// blocking pool. For where io_uring is refused.
    pub fn read(self, storage: &Storage, pool: &Arc<aligned::Pool>) -> std::io::Result<Vec<Bytes>> {
        let got = vec![0; self.reads.len()];
        self.finish(storage, pool.take(), got)
    }

    /// Reads the plan into a buffer of `pool` through `ring` and cuts it into frames. A read the ring left
    /// short of what a piece needs, or failed, is read again (or its error reported) on the blocking pool.
    pub async fn read_uring(
        mut self,
        storage: Arc<Storage>,
        pool: &Arc<aligned::Pool>,
        ring: &Ring,
    ) -> std::io::Result<Vec<Bytes>> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let ops: Vec<ReadOp> = self
            .reads
            .iter()
            .map(|r| ReadOp { fd: r.file.fd, offset: r.start, at: r.at, len: (r.end - r.start) as usize })
            .collect();
        // The ring holds the descriptors open until the reads complete, even where this chunk is dropped
        // first: the copies opened for it, and the storage holding the direct shards'.
        let files: Vec<Arc<std::fs::File>> = self.reads.iter().filter_map(|r| r.file.keep.clone()).collect();
        let keep: crate::storage::uring::Keep = Arc::new((storage.clone(), files));
        let (buf, results) = ring.read(pool.take(), &ops, keep).await?;
        let got: Vec<usize> = results.into_iter().map(|r| r.unwrap_or(0)).collect();
        if self.reads.iter().zip(&got).all(|(r, &got)| r.start + got as u64 >= r.need_end) {
            return self.finish(&storage, buf, got);
        }
        tokio::task::spawn_blocking(move || self.finish(&storage, buf, got)).await.map_err(std::io::Error::other)?
    }

    /// Completes the reads that returned `got` bytes each (a short or failed one is read again with
    /// `pread`, or its error reported) and cuts the buffer into frames.
    fn finish(self, storage: &Storage, mut buf: aligned::Buffer, got: Vec<usize>) -> std::io::Result<Vec<Bytes>> {
        if let Some(e) = self.error {
            return Err(e);
        }
        for (r, got) in self.reads.iter().zip(got) {
            let window = &mut buf.window()[r.at..r.at + (r.end - r.start) as usize];
            storage.finish_direct(r.shard, &r.file, window, r.start, (r.need_end - r.start) as usize, got)?;
        }
        buf.set_len(self.used as usize);
        let shared = Bytes::from_owner(buf);
        let mut frames = Vec::new();
        let mut small = Vec::new();
        for piece in self.pieces {
            match piece {
                Piece::Inline(bytes) => small.extend_from_slice(&bytes),
                Piece::Data { len, place } if len < SMALL_PIECE => {
                    small.extend_from_slice(&shared[place..place + len as usize]);
                }
                Piece::Data { len, place } => {
                    if !small.is_empty() {
                        frames.push(Bytes::from(std::mem::take(&mut small)));
                    }
                    frames.push(shared.slice(place..place + len as usize));
                }
            }
        }
        if !small.is_empty() {
            frames.push(Bytes::from(small));
        }
        Ok(frames)
    }

    /// Reads planned so far.
    #[cfg(test)]
    pub fn reads(&self) -> usize {
        self.reads.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{fixtures, IoMode};

    #[test]
    fn ranges_whose_blocks_touch_or_lie_close_are_one_read() {
        let (dir, index) = fixtures::dataset(40, 20_000, 2);
        let storage = Arc::new(fixtures::open(dir.path(), &index, IoMode::Direct));
        let bytes = std::fs::read(dir.path().join(&index.shards[0].path)).unwrap();
        let shard1 = std::fs::read(dir.path().join(&index.shards[1].path)).unwrap();
        let pool = aligned::Pool::new(1 << 20, 1);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let ring = runtime.block_on(async { Ring::new() }).ok();
        let read = |plan: ChunkPlan, via_uring: bool| match (&ring, via_uring) {
            (Some(ring), true) => runtime.block_on(plan.read_uring(storage.clone(), &pool, ring)),
            _ => plan.read(&storage, &pool),
        };
        // Read through io_uring, and by `pread` alone (where io_uring is refused).
        for via_uring in [true, false] {
            let mut plan = ChunkPlan::new(1 << 20);
            // 100..5000 and 5100..6000 share a block; 20000.. is within MERGE_GAP of that read's end;
            // 200000 is far; then shard 1, which never merges with shard 0.
            let ranges = [(0, 100, 4900), (0, 5100, 900), (0, 20_000, 10), (0, 200_000, 10), (1, 0, 10)];
            for (shard, offset, len) in ranges {
                assert_eq!(plan.data(&storage, shard, offset, len), len);
            }
            plan.inline(b"framing".to_vec());
            assert_eq!(plan.reads(), 3);
            let frames = read(plan, via_uring).unwrap();
            let got: Vec<u8> = frames.iter().flat_map(|f| f.to_vec()).collect();
            let want = [
                &bytes[100..5000],
                &bytes[5100..6000],
                &bytes[20_000..20_010],
                &bytes[200_000..200_010],
                &shard1[..10],
                b"framing",
            ];
            assert_eq!(got, want.concat(), "io_uring: {via_uring}");
        }
        // A file cut short under the server fails a read that two ranges share when the cut falls in the
        // second one, though the first is whole (no byte past the end is sent as if read).
        let file = std::fs::OpenOptions::new().write(true).open(dir.path().join(&index.shards[0].path)).unwrap();
        file.set_len(5050).unwrap();
        for via_uring in [true, false] {
            let mut plan = ChunkPlan::new(1 << 20);
            assert_eq!((plan.data(&storage, 0, 100, 4900), plan.data(&storage, 0, 5100, 900)), (4900, 900));
            let err = read(plan, via_uring).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "io_uring: {via_uring}: {err}");
        }
        // A range past the shard's indexed size fails the chunk.
        let mut plan = ChunkPlan::new(1 << 20);
        assert_eq!(plan.data(&storage, 0, index.shards[0].size - 5, 10), 0);
        assert!(read(plan, true).unwrap_err().to_string().contains("past the indexed size"));
    }
}
