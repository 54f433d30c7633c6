//! Copying whole objects into the disk tier in the order the epoch's plan first reads them, so the store
//! is read in large parts (ranged GETs of `object_part`, several per object, `stage_objects` objects at
//! once, within the bucket's `object_requests`), and read once: a body that wants bytes of an object
//! being copied has the parts holding them read next and waits for those parts only (`making.rs`), so
//! the first batch never waits for a whole object and no byte is read from the store twice.
//!
//! **What is copied.** A dataset that fits in the tier is copied whole: the plan whose bodies are read
//! gives the order ([`ObjectSource::follow`]), and an object a body reads that is not in the tier yet
//! goes first. A dataset larger than the tier is copied only under `shuffle=blocks` (each epoch reads
//! each object once, within `block_bytes` of objects at a time): then the stager stays at most `ahead`
//! bytes of objects (a block, as far as the tier holds beside two) beyond the furthest object read, so
//! what it copies never evicts what the two blocks being read still need (a mount's window reaches into
//! the next block before the last one is done), and the copies of objects wholly more than `behind` bytes
//! (two blocks) before it are the tier's first to go ([`super::tier::Tier::demote`]: the plan reads them
//! next in a later epoch). What the tier holds beyond those three blocks (a quarter of it, at the default
//! `block_bytes`) keeps copies from one epoch to the next. The furthest object read moves only to objects
//! within `ahead` (at least a block) of it, so a mount's window reaching further than the tier holds (the
//! next epoch, read ahead at the end of one) neither drags it on nor has what the slowest reader still
//! needs evicted first; a read of an object the tier lacks outside the readers' window (`behind` before
//! the furthest read to that far beyond it), once no body has read within it for a second
//! ([`READERS_GONE`]), moves it there, back or on (the readers are there now: a mount reading what one
//! before it read ahead of and dropped). An object of the plan a body reads and not copied yet is copied
//! first (what the tier evicts makes room) where it lies that near; beyond, the body reads its bytes by
//! GETs. Under `shuffle=global` such a dataset is not copied at all (each object would be evicted before
//! its next sample came): it is read by GETs, and the server says so at start and in `/healthz`.
//!
//! **Thread.** The stager runs on a thread of its own (`batchfs-stager`), started with the first order,
//! driving the object runtime: copies are written with `pwrite` (past the page cache where the dataset's
//! copies are read so), off the runtime's workers. It holds its dataset weakly and ends when the dataset
//! is gone.

use super::context::COPY_BUFFER_BYTES;
use super::making::Making;
use super::{ObjectSource, ReadError};
use batchfs::index::{ShardInfo, CHUNK_BYTES};
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// The order objects are copied in, and where the readers are.
#[derive(Default)]
pub(super) struct Stager {
    queue: Mutex<Queue>,
    wake: Arc<Notify>,
    /// Copies being made (or asked for by a body), readable part by part.
    making: Mutex<HashMap<u32, Arc<Making>>>,
    /// Failed copies' warnings (a full disk fails every copy).
    failed_log: super::Throttled,
}

#[derive(Default)]
struct Queue {
    /// Objects in the order the plan being followed first reads them, and the bytes of `order[..i]`.
    order: Vec<u32>,
    before: Vec<u64>,
    /// Each object's position in `order` (`u32::MAX`: none), by object number.
    position: Vec<u32>,
    /// The next position to look at, and the furthest position a body read (near the others).
    next: usize,
    cursor: usize,
    /// Bytes of objects beyond `cursor` that may be copied (`u64::MAX`: all).
    ahead: u64,
    /// Objects wholly more than `behind` bytes of objects before `cursor` are read for this epoch: their
    /// copies are the tier's first to go ([`super::tier::Tier::demote`]); `order[..done]` are so
    /// (`u64::MAX`: none is).
    behind: u64,
    done: usize,
    /// Objects bodies read before they were copied: copied first (a dataset that fits).
    urgent: VecDeque<u32>,
    /// Objects being copied.
    busy: HashSet<u32>,
    /// Objects whose copy failed (a full or failing disk): not tried again until the next order.
    failed: HashSet<u32>,
    started: bool,
    /// `order` is the index's, until a plan gives its own ([`ObjectSource::copy_all`]).
    provisional: bool,
    /// When a body last read within the readers' window (see [`ObjectSource::touched`]).
    readers_seen: Option<Instant>,
}

/// How long no body reads within the readers' window before a read outside it, of an object the tier
/// lacks, is taken for where they are now.
pub(super) const READERS_GONE: Duration = Duration::from_secs(1);

impl ObjectSource {
    /// Follows the plan whose samples, in epoch order, are `samples`: copies its objects into the tier
    /// in the order it first reads them, at most `ahead` bytes of objects beyond the furthest one read
    /// (`u64::MAX`: all of them), and has the tier evict first the copies of objects wholly more than
    /// `behind` bytes of objects before it (`u64::MAX`: none): the plan reads them next in a later epoch,
    /// after what is copied ahead. Nothing without a tier.
    pub fn follow(self: &Arc<Self>, samples: &[u32], ahead: u64, behind: u64) {
        let (Some(_), Some(index)) = (self.tier(), self.index.get()) else { return };
        let mut seen = vec![false; index.shards.len()];
        let mut order = Vec::new();
        for &s in samples {
            if let Some(part) = index.samples[s as usize].parts.first() {
                let n = part.shard as usize;
                if !std::mem::replace(&mut seen[n], true) {
                    order.push(n as u32);
                }
            }
        }
        self.queue_order(order, ahead, behind, false);
    }

    /// Copies every shard into the tier, in index order until a plan gives its own, where the dataset
    /// fits in the tier (called as the dataset opens: its next epochs then read nothing from the store).
    pub fn copy_all(self: &Arc<Self>) {
        let (Some(tier), Some(index)) = (self.tier(), self.index.get()) else { return };
        if index.shards.iter().map(|s| tier.on_disk(s.size)).sum::<u64>() <= tier.cap() {
            self.queue_order((0..index.shards.len() as u32).collect(), u64::MAX, u64::MAX, true);
        }
    }

    /// Follows `order` now: plans are followed as their batches are read, so a new one is where the
    /// readers are (the tail of the last one is in the tier already, copied as it was read).
    fn queue_order(self: &Arc<Self>, order: Vec<u32>, ahead: u64, behind: u64, provisional: bool) {
        let mut q = self.stager.queue.lock().expect("stager");
        if q.order == order && q.ahead == ahead && q.behind == behind {
            return;
        }
        let sizes = |n: &u32| self.file(*n).map_or(0, |f| f.size);
        q.before = std::iter::once(0)
            .chain(order.iter().scan(0, |sum, n| Some(*sum + sizes(n)).inspect(|s| *sum = *s)))
            .collect();
        q.position = vec![u32::MAX; self.objects()];
        for (p, &n) in order.iter().enumerate() {
            q.position[n as usize] = p as u32;
        }
        (q.order, q.ahead, q.behind, q.next, q.cursor, q.done) = (order, ahead, behind, 0, 0, 0);
        q.readers_seen = Some(Instant::now());
        q.failed.clear();
        q.provisional = provisional;
        self.start(&mut q);
    }

    /// Starts the stager's thread, once.
    fn start(self: &Arc<Self>, q: &mut Queue) {
        if std::mem::replace(&mut q.started, true) {
            self.stager.wake.notify_one();
            return;
        }
        let (source, context, wake) = (Arc::downgrade(self), self.context.clone(), self.stager.wake.clone());
        let spawned = std::thread::Builder::new()
            .name("batchfs-stager".into())
            .spawn(move || context.block_on(run(source, wake)));
        if let Err(e) = spawned {
            tracing::warn!(dataset = %self.bucket.url, error = %e, "cannot start the stager: objects are read by GETs");
        }
    }

    /// Notes that a body read object `n`, which the tier holds or not (`held`): the stager may go on
    /// past it, and copies it first if it is missing (and the dataset is copied whole, or the object is
    /// in the plan followed, as under `shuffle=blocks`); the body can then read its parts as they land
    /// ([`ObjectSource::making_of`]).
    pub(super) fn touched(self: &Arc<Self>, n: u32, held: bool) {
        let mut q = self.stager.queue.lock().expect("stager");
        let at = q.position.get(n as usize).copied().unwrap_or(u32::MAX);
        let mut wake = false;
        // The readers are within a window around the furthest object read: from `behind` before it to
        // what the stager copies ahead of it (a block at least). A read beyond is not where they are: a
        // read of a plan followed before, whose objects lie anywhere in this one's order (a mount's window
        // reaches into the next epoch before the last one is done), or a mount's window reaching further
        // than the tier holds. (Within two blocks ahead, each such read moved the furthest read a long
        // step on, and the objects the slowest reader still wanted were evicted first as read and copied
        // again: the store was read 1.0-1.2x a half tier's epoch as a mount's window ran through the next.)
        let reach = q.ahead.max(q.behind / 2);
        let near = |q: &Queue, at: usize| q.before[at] <= q.before[q.cursor + 1].saturating_add(reach);
        let kept = |q: &Queue, at: usize| q.before[at + 1].saturating_add(q.behind) > q.before[q.cursor];
        if at != u32::MAX && near(&q, at as usize) && kept(&q, at as usize) {
            q.readers_seen = Some(Instant::now());
            if at as usize > q.cursor {
                q.cursor = at as usize;
                tracing::debug!(dataset = %self.bucket.url, object = n, position = at, "the furthest object read");
                wake = q.ahead != u64::MAX;
                self.demote_behind(&mut q);
            }
        } else if at != u32::MAX && !held && q.readers_seen.is_none_or(|t| t.elapsed() >= READERS_GONE) {
            // Outside the window, not in the tier, and nothing read within it for a while: the readers are
            // here now (a mount reading what one before it read ahead of and dropped as its loader exited,
            // or a job resumed elsewhere in the epoch), and the stager follows them. Left where it was,
            // every object they read next lay outside it, copied one at a time as a body waited for it, none
            // ahead.
            let at = at as usize;
            q.next = if at < q.cursor { q.next.min(at) } else { q.next.max(at) };
            (q.cursor, q.done, q.readers_seen) = (at, q.done.min(at), Some(Instant::now()));
            tracing::debug!(dataset = %self.bucket.url, object = n, position = at, "the readers are here now");
            wake = q.ahead != u64::MAX;
            self.demote_behind(&mut q);
        }
        // An object of the plan followed that a body reads is wanted now, up to as far as a read moves the
        // furthest one (a mount's window may reach past a block); the tier evicts what was read least
        // recently to make room. Beyond, its bytes are read by GETs: a copy made for them was evicted
        // before the readers came, and copied again then (the mounts' windows run through the next
        // epoch's batches at each stream's place as an epoch ends: whole objects copied twice an epoch).
        let within = q.ahead == u64::MAX || (q.started && at != u32::MAX && near(&q, at as usize));
        if !held && within && !q.busy.contains(&n) && !q.failed.contains(&n) && !q.urgent.contains(&n) {
            q.urgent.push_back(n);
            self.making_entry(n);
            wake = true;
        }
        if wake && q.started {
            self.stager.wake.notify_one();
        }
    }

    /// Has the tier evict first the copies of the objects now wholly more than `behind` bytes of objects
    /// before the furthest one read, each once per order.
    fn demote_behind(&self, q: &mut Queue) {
        let Some(tier) = self.tier().filter(|_| q.behind != u64::MAX) else { return };
        while q.done < q.cursor && q.before[q.done + 1].saturating_add(q.behind) <= q.before[q.cursor] {
            if let Some(file) = self.file(q.order[q.done]) {
                tier.demote(&self.tier_name(file));
                tracing::debug!(dataset = %self.bucket.url, object = q.order[q.done], position = q.done,
                    cursor = q.cursor, "read for this epoch: evicted first");
            }
            q.done += 1;
        }
    }

    /// The copy of object `n` being made, or asked for, if any.
    pub(super) fn making_of(&self, n: u32) -> Option<Arc<Making>> {
        self.stager.making.lock().expect("making").get(&n).cloned()
    }

    fn making_entry(&self, n: u32) -> Arc<Making> {
        self.stager.making.lock().expect("making").entry(n).or_default().clone()
    }

    /// The copy of object `n` is the tier's, or will not be made now: its readers stop waiting.
    fn end_making(&self, n: u32) {
        if let Some(making) = self.stager.making.lock().expect("making").remove(&n) {
            making.end();
        }
    }

    /// The next object to copy, if one may be copied now: one a body asked for first, then (where
    /// `ordered`) the next in the plan's order.
    fn next_to_copy(&self, ordered: bool) -> Option<u32> {
        let mut q = self.stager.queue.lock().expect("stager");
        let held = |n: u32| self.tier().zip(self.file(n)).is_none_or(|(t, f)| t.contains(&self.tier_name(f)));
        while let Some(n) = q.urgent.pop_front() {
            if q.busy.contains(&n) {
                continue;
            }
            if held(n) {
                self.end_making(n);
                continue;
            }
            q.busy.insert(n);
            let position = q.position.get(n as usize);
            let (dataset, cursor) = (&self.bucket.url, q.cursor);
            tracing::debug!(%dataset, object = n, position, cursor, "copying first: a body reads it");
            return Some(n);
        }
        if !ordered {
            return None;
        }
        loop {
            if q.next >= q.order.len() {
                return None;
            }
            let p = q.next;
            let n = q.order[p];
            if q.ahead != u64::MAX && q.before[p + 1] - q.before[q.cursor.min(p)] > q.ahead && p > q.cursor {
                return None;
            }
            q.next += 1;
            if !q.busy.contains(&n) && !q.failed.contains(&n) && !held(n) {
                q.busy.insert(n);
                // Its readers wait for its parts from now on: a body that comes before the copy begins
                // (on another thread) asks for them, rather than reading them by GETs beside the copy.
                self.making_entry(n);
                tracing::debug!(dataset = %self.bucket.url, object = n, position = p, cursor = q.cursor,
                    "copying in the plan's order");
                return Some(n);
            }
        }
    }

    /// Follows `order` as the stager would, without starting its thread, and picks the next object to copy
    /// (for tests that look between the stager's steps: the test is the stager).
    #[cfg(test)]
    pub(super) fn pick_in_order(self: &Arc<Self>, order: Vec<u32>) -> Option<u32> {
        self.follow_unstarted(order, u64::MAX, u64::MAX);
        self.next_to_copy(true)
    }

    /// Follows `order` as [`ObjectSource::follow`] does, `ahead` and `behind` given, without starting the
    /// stager's thread (for tests that play the readers).
    #[cfg(test)]
    pub(super) fn follow_unstarted(self: &Arc<Self>, order: Vec<u32>, ahead: u64, behind: u64) {
        self.stager.queue.lock().expect("stager").started = true;
        self.queue_order(order, ahead, behind, false);
    }

    /// Where the stager has the readers (for tests): the furthest position read, how many of the order's
    /// objects are the tier's first to go, and the objects to copy first.
    #[cfg(test)]
    pub(super) fn stager_place(&self) -> (usize, usize, Vec<u32>) {
        let q = self.stager.queue.lock().expect("stager");
        (q.cursor, q.done, q.urgent.iter().copied().collect())
    }

    /// Whether the stager copies nothing now and has nothing it may copy (for tests).
    #[cfg(test)]
    pub(super) fn stager_idle(&self) -> bool {
        let q = self.stager.queue.lock().expect("stager");
        q.busy.is_empty() && q.urgent.is_empty()
    }

    /// Copies object `n` whole into the tier now, if it is not there (for `hold`; call outside a
    /// runtime). Returns the copy's path.
    pub(super) fn stage_now(&self, n: u32) -> io::Result<PathBuf> {
        self.context.block_here(self.stage_object(n))
    }

    /// Copies object `n` whole into the tier, if it is not there: by ranged GETs of `object_part`, several
    /// at once, into a file under `staging/`, each 4 MiB chunk checked against the index's CRC32C (and
    /// read again where it differs), then renamed into place. Returns the copy's path.
    ///
    /// **Memory.** Each part's GET body is written into the copy as it arrives (no buffer of the part's
    /// own), the parts copied at once within the server's `staging_bytes`, and handed to the disk every MiB
    /// (`sync_file_range`), so what copies hold in memory is bounded and their pages are clean soon after:
    /// a server in a small memory cgroup copying several objects is not filled with dirty pages its
    /// reclaim cannot drop (writes through a mapping of the copy were, and the OOM killer came).
    async fn stage_object(&self, n: u32) -> io::Result<PathBuf> {
        let copied = self.copy_object(n).await;
        // However it ended, the copy is the tier's or will not be made now: its readers stop waiting (none
        // waits for an entry never begun, made when the stager picked the object or a body asked for it).
        self.end_making(n);
        copied
    }

    /// [`ObjectSource::stage_object`]'s copy.
    async fn copy_object(&self, n: u32) -> io::Result<PathBuf> {
        let tier = self.tier().ok_or_else(|| io::Error::other("no disk tier"))?;
        let file = self.file(n).ok_or_else(|| io::Error::other(format!("no object #{n}")))?;
        let name = self.tier_name(file);
        if let Some((path, _)) = tier.get(&name) {
            // Nothing to make: a body that asked for it reads the copy.
            return Ok(path);
        }
        let making = self.making_entry(n);
        let copied = async {
            let copy = tier.begin(&name, file.size)?;
            let parts = file.size.div_ceil(self.part_bytes()) as usize;
            // The copies of a dataset read past the page cache are written past it too: their pages would
            // only be charged to the server, written back and reclaimed (a filesystem that refuses
            // O_DIRECT gets writes through the page cache).
            let direct = self.direct_copies.load(Ordering::Relaxed).then(|| copy.open_direct().ok()).flatten();
            let read_by = direct.as_ref().unwrap_or(copy.file()).try_clone()?;
            making.begin(Arc::new(read_by), direct.is_some(), self.part_bytes(), parts);
            let out = CopyOut { file: copy.file(), direct: direct.as_ref() };
            self.write_whole(n, file, out, |e| copy.failed(e), true, Some(&making)).await?;
            if direct.is_some() {
                // The last aligned write ran past the object's end.
                copy.file().set_len(file.size).map_err(|e| copy.failed(e))?;
            }
            // The disk must have taken every part before the copy is the tier's (an error of the disk's
            // shows here, not at the writes).
            copy.file().sync_data().map_err(|e| copy.failed(e))?;
            copy.commit()
        };
        let path = copied.await?;
        tier.counters.fetched_bytes.fetch_add(file.size, Ordering::Relaxed);
        let (dataset, object) = (&self.bucket.url, &file.path);
        tracing::debug!(%dataset, %object, bytes = file.size, "copied into the disk tier");
        Ok(path)
    }
}

impl ObjectSource {
    /// Copies all of object `n` (`file`) into `out` (a file of its size) by ranged GETs of `object_part`,
    /// up to 8 at once, each taking [`COPY_BUFFER_BYTES`] of the server's `staging_bytes` while it is
    /// copied; with `checked`, each 4 MiB chunk against the index's CRC32C (copied again where it
    /// differs). The parts a body waits for are copied first where the copy is `making` one
    /// ([`Making::next_part`]), else in order. A write that fails is `disk`'s error.
    pub(super) async fn write_whole(
        &self,
        n: u32,
        file: &ShardInfo,
        out: CopyOut<'_>,
        disk: impl Fn(io::Error) -> io::Error,
        checked: bool,
        making: Option<&Making>,
    ) -> io::Result<()> {
        let part = self.part_bytes();
        let parts = file.size.div_ceil(part);
        let in_order = std::sync::atomic::AtomicU64::new(0);
        let next = || match making {
            Some(making) => making.next_part(),
            None => Some(in_order.fetch_add(1, Ordering::Relaxed)).filter(|&k| k < parts),
        };
        let (disk, next, out) = (&disk, &next, &out);
        // Each reader takes room before it picks its part, so the pick is the latest a body asked for: what
        // a part holds while it is copied (its body is written as it arrives), not the part's size.
        let reader = || async move {
            loop {
                let _room = self.context.staging.take(COPY_BUFFER_BYTES.min(file.size)).await;
                let Some(k) = next() else { return Ok::<_, io::Error>(()) };
                let (at, len) = (k * part, part.min(file.size - k * part));
                self.copy_range(Span { n, file, at, len }, out, disk, checked).await?;
                if let Some(making) = making {
                    making.landed(k);
                }
            }
        };
        let readers = (self.limits().requests.clamp(1, 8) as u64).min(parts.max(1));
        futures_util::future::try_join_all((0..readers).map(|_| reader())).await?;
        Ok(())
    }

    /// Copies `span` (its start a multiple of [`CHUNK_BYTES`]) into `out` at the same offset, by one
    /// ranged GET whose body is written as it arrives (no buffer of the part's own, no copy but the one
    /// into the file); with `checked`, the CRC32C of each chunk is folded in as its bytes pass, and a chunk
    /// that differs from the index's is copied again by itself, up to [`super::FETCH_ATTEMPTS`] times. The
    /// copy's bytes are only trusted once this returns `Ok`.
    async fn copy_range(
        &self,
        span: Span<'_>,
        out: &CopyOut<'_>,
        disk: &impl Fn(io::Error) -> io::Error,
        checked: bool,
    ) -> io::Result<()> {
        let Span { file, at, len, .. } = span;
        debug_assert_eq!(at % CHUNK_BYTES, 0, "ranges are checked by whole chunks");
        self.until_checked(file, "copied", vec![(at, len)], |todo| async move {
            let mut differing = Vec::new();
            for (at, len) in todo {
                let streamed = self.retrying(file, || self.stream_into(Span { at, len, ..span }, out, checked));
                let crcs = streamed.await.map_err(ReadError::into_io)?.map_err(disk)?;
                let chunks = crcs.into_iter().enumerate().map(|(k, crc)| (at / CHUNK_BYTES + k as u64, crc));
                differing.extend(
                    chunks
                        .filter(|&(c, crc)| file.chunk_crc(c) != Some(crc))
                        .map(|(c, _)| (c * CHUNK_BYTES, CHUNK_BYTES.min(at + len - c * CHUNK_BYTES))),
                );
            }
            Ok(differing)
        })
        .await
    }

    /// One GET of `span`, its body written to `out` at its offset as it arrives: each piece through the
    /// page cache (writeback started every [`COPY_BUFFER_BYTES`]), or gathered into an aligned buffer of
    /// that size written past it; returns the CRC32C of each [`CHUNK_BYTES`] chunk where `checked` (else
    /// none), or the disk's error (inner: not worth asking the store again).
    async fn stream_into(
        &self,
        span: Span<'_>,
        out: &CopyOut<'_>,
        checked: bool,
    ) -> Result<io::Result<Vec<u32>>, ReadError> {
        let Span { n, file, at, len } = span;
        let (result, _held) = self.open_get(n, file, at, len, len.min(COPY_BUFFER_BYTES)).await?;
        let mut body = result.into_stream();
        let mut writer = Writer::new(out, at, &self.context.copy_buffers);
        let (mut crcs, mut crc, mut got) = (Vec::new(), 0u32, 0u64);
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| io::Error::other(format!("{}: {e}", self.shown(file).display())))?;
            if got + piece.len() as u64 > len {
                return Err(self.short_body(file, at, len, got + piece.len() as u64));
            }
            self.counters.bytes.fetch_add(piece.len() as u64, Ordering::Relaxed);
            if checked {
                // The piece's bytes split at chunk ends, each folded into its chunk's CRC.
                let mut rest = &piece[..];
                while !rest.is_empty() {
                    let into = (got + (piece.len() - rest.len()) as u64) % CHUNK_BYTES;
                    let take = rest.len().min((CHUNK_BYTES - into) as usize);
                    crc = batchfs::crc::crc32c_append(crc, &rest[..take]);
                    rest = &rest[take..];
                    if into + take as u64 == CHUNK_BYTES {
                        crcs.push(std::mem::take(&mut crc));
                    }
                }
            }
            if let Err(e) = writer.write(&piece) {
                return Ok(Err(e));
            }
            got += piece.len() as u64;
        }
        if got != len {
            return Err(self.short_body(file, at, len, got));
        }
        if checked && !len.is_multiple_of(CHUNK_BYTES) {
            crcs.push(crc);
        }
        Ok(writer.finish().map(|()| crcs))
    }
}

/// The `len` bytes at `at` of object `n` (`file`).
#[derive(Clone, Copy)]
struct Span<'a> {
    n: u32,
    file: &'a ShardInfo,
    at: u64,
    len: u64,
}

/// Where a copy being made is written: `file`, through the page cache, or `direct`, the same file opened
/// with `O_DIRECT` (the copies of a dataset read past the page cache).
pub(super) struct CopyOut<'a> {
    pub file: &'a std::fs::File,
    pub direct: Option<&'a std::fs::File>,
}

impl<'a> CopyOut<'a> {
    /// Writes through the page cache into `file`.
    pub fn cached(file: &'a std::fs::File) -> CopyOut<'a> {
        CopyOut { file, direct: None }
    }
}

/// Writes one range of a copy, in order, as its pieces come: through the page cache, the writeback
/// started every [`COPY_BUFFER_BYTES`] (so they do not stay dirty in memory); or past it, gathered into
/// an aligned buffer of that size and written whole (the last write padded to the alignment: the copy is
/// cut to its object's size once every range is written).
struct Writer<'a> {
    file: &'a std::fs::File,
    /// The file opened with `O_DIRECT` and the aligned buffer its writes are gathered in, if so written.
    direct: Option<(&'a std::fs::File, crate::aligned::Buffer)>,
    /// Where the bytes not written or not handed to the disk yet start, and how many there are.
    at: u64,
    pending: u64,
}

impl<'a> Writer<'a> {
    fn new(out: &CopyOut<'a>, at: u64, pool: &Arc<crate::aligned::Pool>) -> Writer<'a> {
        Writer { file: out.file, direct: out.direct.map(|d| (d, pool.take())), at, pending: 0 }
    }

    fn write(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let Some((direct, buffer)) = self.direct.as_mut() else {
            self.file.write_all_at(bytes, self.at + self.pending)?;
            self.pending += bytes.len() as u64;
            if self.pending >= COPY_BUFFER_BYTES {
                start_writeback(self.file, self.at, self.pending)?;
                (self.at, self.pending) = (self.at + self.pending, 0);
            }
            return Ok(());
        };
        while !bytes.is_empty() {
            let window = buffer.window();
            let filled = self.pending as usize;
            let take = bytes.len().min(window.len() - filled);
            window[filled..filled + take].copy_from_slice(&bytes[..take]);
            (self.pending, bytes) = (self.pending + take as u64, &bytes[take..]);
            if self.pending as usize == window.len() {
                direct.write_all_at(window, self.at)?;
                (self.at, self.pending) = (self.at + self.pending, 0);
            }
        }
        Ok(())
    }

    /// Writes (or hands to the disk) what is pending.
    fn finish(mut self) -> io::Result<()> {
        use crate::aligned::align_up;
        use std::os::unix::fs::FileExt;
        match self.direct.as_mut() {
            Some(_) if self.pending == 0 => Ok(()),
            Some((direct, buffer)) => {
                let (filled, padded) = (self.pending as usize, align_up(self.pending) as usize);
                let window = buffer.window();
                window[filled..padded].fill(0);
                direct.write_all_at(&window[..padded], self.at)
            }
            None => start_writeback(self.file, self.at, self.pending),
        }
    }
}

/// Starts the writeback of the `len` bytes at `at` of `file` now (Linux; elsewhere the flush before the
/// rename writes them).
fn start_writeback(file: &std::fs::File, at: u64, len: u64) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    if len > 0 {
        use std::os::fd::AsRawFd;
        // SAFETY: sync_file_range reads no memory of ours; the descriptor is open for the call (borrowed).
        let rc = unsafe {
            libc::sync_file_range(
                file.as_raw_fd(),
                at as libc::off64_t,
                len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            )
        };
        // A filesystem that cannot start writeback this way (EINVAL) leaves it to the flush.
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, at, len);
    Ok(())
}

/// How many times `stage_objects` copies may be made at once for the objects bodies wait for (a batch of
/// a global shuffle reads from every object of a small dataset).
const URGENT_COPIES: usize = 16;

/// The stager's loop: copies what [`ObjectSource::next_to_copy`] gives, `stage_objects` at once, until
/// the dataset is gone.
async fn run(source: Weak<ObjectSource>, wake: Arc<Notify>) {
    let mut copying = FuturesUnordered::new();
    loop {
        let Some(this) = source.upgrade() else { return };
        // Objects bodies wait for start beyond `stage_objects` (up to URGENT_COPIES times as many at
        // once): a copy takes no memory until its parts are read, within `staging_bytes` for them all.
        while copying.len() < URGENT_COPIES * this.limits().stage_objects {
            let Some(n) = this.next_to_copy(copying.len() < this.limits().stage_objects) else { break };
            let this = this.clone();
            copying.push(async move {
                let copied = this.stage_object(n).await;
                // No room beside the copies being made: not a failure, the object may be asked for again.
                let busy = copied.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::WouldBlock);
                let said = copied.as_ref().err().filter(|_| !busy).map(|e| (e, this.stager.failed_log.pass()));
                if let Some((e, Some(held_back))) = said {
                    let object = this.path_of(n);
                    tracing::warn!(dataset = %this.bucket.url, object = %object.display(), error = %e, held_back,
                        "not copied into the disk tier: read by GETs");
                }
                let mut q = this.stager.queue.lock().expect("stager");
                q.busy.remove(&n);
                if copied.is_err() && !busy {
                    q.failed.insert(n);
                }
            });
        }
        drop(this);
        if copying.is_empty() {
            // Idle: woken by a new order or a body's read; looks now and then whether the dataset is gone.
            let _ = tokio::time::timeout(Duration::from_secs(1), wake.notified()).await;
        } else {
            tokio::select! {
                _ = copying.next() => {}
                _ = wake.notified() => {}
            }
        }
    }
}
