//! Reads of an object dataset's bytes: from the disk tier where it holds the object, else by ranged GETs
//! of checked units through the block cache; and whole objects read into memory (`resident`).
//!
//! **Bridge.** Bodies call [`ObjectSource::read_many`] from the blocking pool: copies in the tier are read
//! there, in that thread; GETs run on the object runtime ([`super::ObjectContext::wait`]).

use super::units::{Read, Unit};
use super::{ObjectSource, FETCH_ATTEMPTS};
use batchfs::index::{ShardInfo, CHUNK_BYTES};
use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use object_store::{GetOptions, GetRange};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A copy in the tier opened for reading, with `O_DIRECT` or not.
struct CopyFile {
    /// Registered with the tier ([`super::tier::Tier::opened`]): counted, once evicted, until closed.
    file: Arc<std::fs::File>,
    direct: bool,
    /// Its name in the tier.
    name: String,
}

/// `len` bytes at `offset` of `file`, opened with `O_DIRECT`: the aligned blocks around them read into an
/// aligned buffer, past the page cache, and the bytes cut out of it.
fn read_direct(file: &std::fs::File, offset: u64, len: u64) -> io::Result<Bytes> {
    use crate::aligned::{align_down, align_up, DIRECT_ALIGN};
    let (start, end) = (align_down(offset), align_up(offset + len));
    let (span, align) = ((end - start) as usize, DIRECT_ALIGN as usize);
    let mut buffer = vec![0u8; span + align];
    let skew = (align - buffer.as_ptr() as usize % align) % align;
    let (want, mut got) = ((offset + len - start) as usize, 0);
    while got < want {
        // Whole aligned blocks; only the file's end reads short, and only the last read.
        match file.read_at(&mut buffer[skew + got..skew + span], start + got as u64)? {
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the copy is shorter than its object")),
            n => got += n,
        }
    }
    let from = skew + (offset - start) as usize;
    Ok(Bytes::from(buffer).slice(from..from + len as usize))
}

/// Why a read of an object dataset failed.
#[derive(Debug)]
pub enum ReadError {
    /// Object `shard` is not the one indexed: refuse it.
    Changed {
        shard: u32,
        why: String,
    },
    Io(io::Error),
}

impl ReadError {
    /// As an I/O error (a change found while reading an object whole: the listing is no longer true).
    pub(super) fn into_io(self) -> io::Error {
        match self {
            ReadError::Changed { why, .. } => io::Error::other(format!("{why} (changed since it was listed)")),
            ReadError::Io(e) => e,
        }
    }
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

impl ObjectSource {
    /// Object `n` (`file`, as indexed) read whole into the server's own memory and checked against the
    /// index's CRC32C of each of its chunks: from its copy in the disk tier (made now where the tier has
    /// none, so a restarted server reads it from there), else by ranged GETs of `object_part` several at
    /// once, each `If-Match` its ETag (a chunk that differs is read again, up to [`FETCH_ATTEMPTS`] times).
    pub fn hold(&self, n: u32, file: &ShardInfo) -> io::Result<batchfs::mmap::MappedFile> {
        if let Some(copy) =
            self.context.tier.as_ref().filter(|t| t.on_disk(file.size) <= t.cap()).map(|_| self.stage_now(n))
        {
            match copy.and_then(|path| self.read_copy(n, file, &path)) {
                Ok(held) => return Ok(held),
                Err(e) => tracing::warn!(dataset = %self.bucket.url, error = %e, "holding from the store instead"),
            }
        }
        batchfs::mmap::MappedFile::in_memory(file.size as usize, |memory| {
            self.context.block_here(self.read_into(n, file, memory))
        })
    }

    /// The copy of object `n` at `path` read into memory, checked against the index.
    fn read_copy(&self, n: u32, file: &ShardInfo, path: &std::path::Path) -> io::Result<batchfs::mmap::MappedFile> {
        let copy = std::fs::File::open(path)?;
        // `in_memory` hands over whole pages: only the object's own bytes are read into them.
        let len = file.size as usize;
        let held = batchfs::mmap::MappedFile::in_memory(len, |memory| copy.read_exact_at(&mut memory[..len], 0))?;
        match differing_chunk(file, held.bytes()) {
            None => Ok(held),
            Some(k) => {
                let why = format!("chunk {k} differs from the index");
                if let Some(tier) = self.tier() {
                    tier.remove(&self.tier_name(file), &why);
                }
                Err(io::Error::new(io::ErrorKind::InvalidData, format!("{}: {why}", self.path_of(n).display())))
            }
        }
    }

    pub(super) async fn read_into(&self, n: u32, file: &ShardInfo, memory: &mut [u8]) -> io::Result<()> {
        self.read_range_into(n, file, 0, &mut memory[..file.size as usize]).await
    }

    /// The largest read of an object in one GET (`object_part`, whole [`CHUNK_BYTES`] chunks).
    pub(super) fn part_bytes(&self) -> u64 {
        self.limits().part.div_ceil(CHUNK_BYTES).max(1) * CHUNK_BYTES
    }

    /// Fills `memory` with the bytes at `at` (a multiple of [`CHUNK_BYTES`]) of object `n`, by ranged
    /// GETs of [`ObjectSource::part_bytes`] several at once, each chunk checked against the index's CRC32C
    /// and read again by itself where it differs, up to [`FETCH_ATTEMPTS`] times.
    pub(super) async fn read_range_into(&self, n: u32, file: &ShardInfo, at: u64, memory: &mut [u8]) -> io::Result<()> {
        debug_assert_eq!(at % CHUNK_BYTES, 0, "ranges are checked by whole chunks");
        let todo = parts_of(memory, self.part_bytes()).into_iter().map(|(k, slice)| (at + k, slice)).collect();
        self.until_checked(file, "read", todo, |todo| async move {
            // Each CHUNK_BYTES chunk of what was read against its CRC32C from the index.
            Ok(self
                .read_parts(n, file, todo)
                .await?
                .into_iter()
                .flat_map(|(offset, slice)| parts_of(slice, CHUNK_BYTES).into_iter().map(move |(k, c)| (offset + k, c)))
                .filter(|(at, chunk)| file.chunk_crc(at / CHUNK_BYTES) != Some(batchfs::crc::crc32c(chunk)))
                .collect())
        })
        .await
    }

    /// Reads (or copies) the ranges `todo` of `file` by `pass`, which returns the chunks among them that
    /// differ from the index's CRC32Cs: those are passed again by themselves (counted, and logged as
    /// `what`), up to [`FETCH_ATTEMPTS`] times, then refused.
    pub(super) async fn until_checked<R, F: Future<Output = io::Result<Vec<R>>>>(
        &self,
        file: &ShardInfo,
        what: &str,
        mut todo: Vec<R>,
        mut pass: impl FnMut(Vec<R>) -> F,
    ) -> io::Result<()> {
        for attempt in 1..=FETCH_ATTEMPTS {
            todo = pass(todo).await?;
            if todo.is_empty() {
                return Ok(());
            }
            self.counters.bad_checksums.fetch_add(todo.len() as u64, Ordering::Relaxed);
            let (dataset, object) = (&self.bucket.url, &file.path);
            tracing::warn!(%dataset, %object, attempt, what, "ranges failed their checksums: made again");
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}: its bytes keep differing from the index's checksums (the object rewritten in the store since \
                 it was indexed, or an index of an earlier release built from bytes corrupted on their way from \
                 the store: remove the dataset's index and restart to index it anew)",
                self.shown(file).display()
            ),
        ))
    }

    /// Fills each `(offset, slice)` with the bytes at `offset` of `object` (storage number `n`), by one
    /// ranged GET each, up to 8 at once; returns them, filled.
    pub(super) async fn read_parts<'a>(
        &self,
        n: u32,
        file: &ShardInfo,
        parts: Vec<(u64, &'a mut [u8])>,
    ) -> io::Result<Vec<(u64, &'a mut [u8])>> {
        let reads: Vec<_> = parts.into_iter().map(|(offset, slice)| self.read_part(n, file, offset, slice)).collect();
        futures_util::stream::iter(reads).buffer_unordered(self.limits().requests.clamp(1, 8)).try_collect().await
    }

    async fn read_part<'a>(
        &self,
        n: u32,
        file: &ShardInfo,
        offset: u64,
        slice: &'a mut [u8],
    ) -> io::Result<(u64, &'a mut [u8])> {
        let bytes = self.get(n, file, offset, slice.len() as u64).await.map_err(ReadError::into_io)?;
        slice.copy_from_slice(&bytes);
        Ok((offset, slice))
    }

    /// The ranges of `wanted` that reading a batch ahead of its body should bring into the block cache
    /// by GETs: none of an object the disk tier holds (its body reads the copy as a local shard is read;
    /// read ahead, the copy was read into memory, dropped, and read again by the body), nor of one being
    /// copied (the parts holding them are asked for next, not waited on). Each object counts as read for
    /// the stager (`touched`), as its body's read will: one within the readers' window is copied now.
    pub fn to_read_ahead(self: &Arc<Self>, wanted: &[(u32, u64, u64)]) -> Vec<(u32, u64, u64)> {
        let Some(tier) = self.tier() else { return wanted.to_vec() };
        let mut held: HashMap<u32, bool> = HashMap::new();
        let mut out = Vec::new();
        for &(n, offset, len) in wanted {
            let in_tier = *held.entry(n).or_insert_with(|| {
                let in_tier = self.file(n).is_some_and(|file| tier.contains(&self.tier_name(file)));
                self.touched(n, in_tier);
                in_tier
            });
            if in_tier {
                continue;
            }
            match self.making_of(n) {
                Some(being_made) => being_made.ask(offset, len),
                None => out.push((n, offset, len)),
            }
        }
        out
    }

    /// The bytes of each wanted range `(object, offset, len)`, in order: from the disk tier where it holds
    /// the object (read here: call on the blocking pool), else read through the block cache.
    pub fn read_many(self: &Arc<Self>, wanted: &[(u32, u64, u64)]) -> Result<Vec<Bytes>, ReadError> {
        let mut out: Vec<Option<Bytes>> = vec![None; wanted.len()];
        if self.tier().is_some() {
            let mut copies: HashMap<u32, Option<CopyFile>> = HashMap::new();
            let mut making = Vec::new();
            for (i, &(n, offset, len)) in wanted.iter().enumerate() {
                let copy = copies.entry(n).or_insert_with(|| {
                    let copy = self.open_copy(n, true);
                    self.touched(n, copy.is_some());
                    copy
                });
                if copy.is_none() {
                    if let Some(being_made) = self.making_of(n) {
                        // Being copied: asked for first, then read from its parts as they land (checked
                        // already), rather than by GETs of their own.
                        being_made.ask(offset, len);
                        making.push((i, being_made));
                        continue;
                    }
                    // Not being copied now: the copy may have landed since this body looked for it (the
                    // tier holds a copy before its making ends), and the body's other ranges of the object
                    // read it. Before, they were read by GETs: the store read twice for them.
                    *copy = self.open_copy(n, true);
                }
                match copy {
                    Some(file) => out[i] = self.read_from_copy(n, file, offset, len),
                    None => {
                        tracing::debug!(dataset = %self.bucket.url, object = n, offset, "read by GET: not being copied")
                    }
                }
            }
            let started = std::time::Instant::now();
            let waited = !making.is_empty();
            for (i, copy) in making {
                let (n, offset, len) = wanted[i];
                let landed = copy.wait(offset, len, self.limits().timeout);
                out[i] = landed.and_then(|(file, direct)| self.read_from_making(&file, direct, offset, len));
                if out[i].is_none() {
                    let dataset = &self.bucket.url;
                    tracing::debug!(%dataset, object = n, offset, "read by GET: its copy did not land");
                }
            }
            if waited {
                let ms = started.elapsed().as_millis() as u64;
                tracing::debug!(dataset = %self.bucket.url, ms, "waited for the parts of copies being made");
            }
        }
        let missing: Vec<(u32, u64, u64)> =
            wanted.iter().zip(&out).filter(|(_, got)| got.is_none()).map(|(w, _)| *w).collect();
        if !missing.is_empty() {
            let this = self.clone();
            let mut fetched = self.context.wait(async move { this.read_many_async(&missing).await })?.into_iter();
            for slot in out.iter_mut().filter(|got| got.is_none()) {
                *slot = fetched.next();
            }
        }
        Ok(out.into_iter().map(|b| b.expect("every range read")).collect())
    }

    /// Object `n`'s copy in the tier, opened, if the tier holds one checked: a copy found at start is
    /// checked against the index first where `may_check` ([`check_copy`], once per copy: blocks, so only
    /// on the blocking pool), and taken as missing where not (the runtime's workers: a read on the blocking
    /// pool checks it).
    fn open_copy(&self, n: u32, may_check: bool) -> Option<CopyFile> {
        let (tier, file) = (self.tier()?, self.file(n)?);
        let name = self.tier_name(file);
        if !may_check && tier.is_unchecked(&name) {
            return None;
        }
        let path = tier.checked_copy(&name, |path| check_copy(file, path))?;
        // Past the page cache, as a local dataset larger than memory is read, where its copies are read
        // so (a filesystem that refuses O_DIRECT gets positioned reads through the page cache).
        if self.direct_copies.load(Ordering::Relaxed) {
            use std::os::unix::fs::OpenOptionsExt;
            match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path) {
                Ok(file) => return opened(tier, CopyFile { file: Arc::new(file), direct: true, name }),
                // Refused (the filesystem does not do O_DIRECT): every copy is read through the page cache.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => self.read_copies_directly(false),
                // Whatever else it is, the plain open below meets it too, and says so.
                Err(_) => {}
            }
        }
        match std::fs::File::open(&path) {
            Ok(copy) => opened(tier, CopyFile { file: Arc::new(copy), direct: false, name }),
            Err(e) => {
                // Gone from the disk under the tier: forgotten, so nothing takes it for held again.
                tier.remove(&name, &e.to_string());
                None
            }
        }
    }

    /// Whether object `n` is read now from a copy in the tier opened with `O_DIRECT`, by the direct path of
    /// local shards (`storage/direct.rs`): the copies of a dataset larger than half the server's memory.
    pub fn direct_copy_held(&self, n: u32) -> bool {
        self.direct_copies.load(Ordering::Relaxed)
            && self.tier().zip(self.file(n)).is_some_and(|(tier, file)| {
                self.open_copies.get(tier, n, false).is_some() || tier.contains(&self.tier_name(file))
            })
    }

    /// Object `n`'s copy in the tier, opened with `O_DIRECT` and checked, for `len` bytes of it read now
    /// by the direct path (counted as the tier's, and as a read of the object for the stager); `None` where
    /// the tier does not hold it, or not checked yet, or it is not read so: the bytes are then read by
    /// [`Self::read_many`], on the blocking pool, which checks it first. Never blocks on a check: called in
    /// a body's `poll_frame`, on a worker. (Before, it read a copy found at start whole into one buffer and
    /// checked it there, a worker stalled for seconds and gigabytes allocated, by every body at once.)
    pub fn direct_copy(self: &Arc<Self>, n: u32, len: u64) -> Option<Arc<std::fs::File>> {
        if !self.direct_copies.load(Ordering::Relaxed) {
            return None;
        }
        let tier = self.tier()?;
        if self.file(n).is_some_and(|file| tier.is_unchecked(&self.tier_name(file))) {
            return None;
        }
        let file = self.open_copies.get(tier, n, true).or_else(|| {
            let copy = self.open_copy(n, false).filter(|c| c.direct)?;
            self.open_copies.put(tier, n, copy.name, copy.file.clone());
            Some(copy.file)
        });
        self.touched(n, file.is_some());
        let file = file?;
        self.served_from_tier(len);
        self.counters.tier_direct_bytes.fetch_add(len, Ordering::Relaxed);
        Some(file)
    }

    /// A read of object `n`'s copy by the direct path failed (`e`): the copy is dropped from the tier, so
    /// the next reads of the object go to the store.
    pub fn direct_copy_failed(&self, n: u32, e: &io::Error) {
        self.open_copies.forget(n);
        if let (Some(tier), Some(file)) = (self.tier(), self.file(n)) {
            tier.remove(&self.tier_name(file), &e.to_string());
        }
    }

    /// `len` bytes at `offset` of object `n` from its open copy `copy`; `None` where the read fails (the
    /// copy is then removed, and the bytes read from the store).
    fn read_from_copy(&self, n: u32, copy: &CopyFile, offset: u64, len: u64) -> Option<Bytes> {
        let read = if copy.direct {
            read_direct(&copy.file, offset, len)
        } else {
            let mut bytes = vec![0; len as usize];
            copy.file.read_exact_at(&mut bytes, offset).map(|()| Bytes::from(bytes))
        };
        match read {
            Ok(bytes) => {
                self.served_from_tier(len);
                Some(bytes)
            }
            Err(e) => {
                if let (Some(tier), Some(file)) = (self.tier(), self.file(n)) {
                    tier.remove(&self.tier_name(file), &e.to_string());
                }
                None
            }
        }
    }

    /// `len` bytes at `offset` of a copy being made (opened with `O_DIRECT` where `direct`), from parts
    /// that landed; `None` where the read fails (the bytes are then read from the store).
    fn read_from_making(&self, copy: &std::fs::File, direct: bool, offset: u64, len: u64) -> Option<Bytes> {
        let bytes = if direct {
            read_direct(copy, offset, len).ok()?
        } else {
            let mut bytes = vec![0; len as usize];
            copy.read_exact_at(&mut bytes, offset).ok()?;
            Bytes::from(bytes)
        };
        self.served_from_tier(len);
        Some(bytes)
    }

    async fn read_many_async(self: &Arc<Self>, wanted: &[(u32, u64, u64)]) -> Result<Vec<Bytes>, ReadError> {
        let mut units: Vec<Unit> = wanted.iter().flat_map(|&(n, o, l)| self.units(n, o, l)).collect();
        units.sort_unstable();
        units.dedup();
        let got = self.context.cache.get_or_fetch(self, &units).await?;
        let by_unit: HashMap<Unit, Bytes> = units.into_iter().zip(got).collect();
        wanted
            .iter()
            .map(|&(n, offset, len)| {
                // The same units as above, in order: each range is cut out of its own.
                let mine = self.units(n, offset, len);
                let (end, mut at) = (offset + len, offset);
                let mut out = Vec::new();
                for unit in &mine {
                    let bytes = &by_unit[unit];
                    let (start, stop) = (at.max(unit.offset), end.min(unit.offset + unit.len));
                    if start > at {
                        break;
                    }
                    if start >= stop {
                        continue;
                    }
                    let piece = bytes.slice((start - unit.offset) as usize..(stop - unit.offset) as usize);
                    if start == offset && stop == end {
                        return Ok(piece);
                    }
                    out.extend_from_slice(&piece);
                    at = stop;
                }
                if at != end {
                    return Err(ReadError::Io(io::Error::other(format!(
                        "{}: {len} bytes at {offset} lie outside the indexed object",
                        self.path_of(n).display()
                    ))));
                }
                Ok(Bytes::from(out))
            })
            .collect()
    }

    /// Reads `read` (units of one object, coalesced) with one ranged GET, checks every unit, and returns
    /// each unit's bytes; a unit that fails its check is read again by itself, up to [`FETCH_ATTEMPTS`]
    /// reads in all.
    pub(super) async fn fetch(&self, read: &Read, units: &[Unit]) -> Result<Vec<Bytes>, ReadError> {
        let file = self.file(read.object).expect("an indexed object");
        let bytes = self.get(read.object, file, read.offset, read.len).await?;
        // Each unit gets bytes of its own, unless it is the whole read: a slice keeps the whole GET's buffer
        // alive for as long as the block cache holds that unit, so a cache counting `object_cache` bytes of
        // units could hold several times as many (reads of sparse samples, up to `object_part` with their
        // gaps, each kept for a few samples).
        let own = |b: Bytes| if b.len() == bytes.len() { b } else { Bytes::copy_from_slice(&b) };
        let mut out: Vec<Bytes> = units
            .iter()
            .map(|u| own(bytes.slice((u.offset - read.offset) as usize..(u.offset - read.offset + u.len) as usize)))
            .collect();
        for (unit, got) in units.iter().zip(&mut out) {
            let mut attempt = 1;
            while !unit.holds(got) {
                self.counters.bad_checksums.fetch_add(1, Ordering::Relaxed);
                let why = format!(
                    "{}: {} bytes at {} do not match the index's checksum",
                    self.shown(file).display(),
                    unit.len,
                    unit.offset
                );
                if attempt >= FETCH_ATTEMPTS {
                    return Err(ReadError::Io(io::Error::new(io::ErrorKind::InvalidData, why)));
                }
                tracing::warn!(dataset = %self.bucket.url, %why, attempt, "reading it again");
                attempt += 1;
                *got = self.get(read.object, file, unit.offset, unit.len).await?;
            }
        }
        Ok(out)
    }

    /// One ranged GET of `object` (storage number `n`), `If-Match` its indexed ETag, its body collected.
    /// A request that fails on the way is made again ([`ObjectSource::retrying`]).
    pub(super) async fn get(&self, n: u32, file: &ShardInfo, offset: u64, len: u64) -> Result<Bytes, ReadError> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        self.retrying(file, || self.get_once(n, file, offset, len)).await
    }

    /// `attempt` made again, with backoff, while it fails on the way (object_store's own retries given up,
    /// or a body cut short) and `object_retry_for` from the first attempt lasts; an object changed since
    /// it was indexed is not asked for again.
    pub(super) async fn retrying<T, F: Future<Output = Result<T, ReadError>>>(
        &self,
        file: &ShardInfo,
        mut attempt: impl FnMut() -> F,
    ) -> Result<T, ReadError> {
        let deadline = tokio::time::Instant::now() + self.limits().retry_for;
        let mut backoff = Duration::from_millis(100);
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let result = match tokio::time::timeout(left, attempt()).await {
                Ok(result) => result,
                Err(_) => Err(ReadError::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{}: no answer within object_retry_for", self.shown(file).display()),
                ))),
            };
            match result {
                Err(ReadError::Io(e)) if tokio::time::Instant::now() + backoff < deadline => {
                    if !self.counters.retried(&self.bucket.url, &e) {
                        tracing::debug!(dataset = %self.bucket.url, error = %e, "a GET failed: asking again");
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(ReadError::Io(e)) => {
                    self.counters.gave_up(&self.bucket.url, &e);
                    return Err(ReadError::Io(e));
                }
                other => return other,
            }
        }
    }

    async fn get_once(&self, n: u32, file: &ShardInfo, offset: u64, len: u64) -> Result<Bytes, ReadError> {
        let (result, _held) = self.open_get(n, file, offset, len, len).await?;
        let bytes =
            result.bytes().await.map_err(|e| io::Error::other(format!("{}: {e}", self.shown(file).display())))?;
        self.counters.bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        if bytes.len() as u64 != len {
            return Err(self.short_body(file, offset, len, bytes.len() as u64));
        }
        Ok(bytes)
    }

    /// A ranged GET of `len` bytes at `offset` of `object` (storage number `n`), `If-Match` its indexed
    /// ETag, answered: its body not read yet, held within `room` bytes of the server's `get_bytes` and
    /// one of the bucket's `object_requests` (given back when the guards drop). An object that is not the
    /// indexed one (its ETag or size) is [`ReadError::Changed`].
    pub(super) async fn open_get(
        &self,
        n: u32,
        file: &ShardInfo,
        offset: u64,
        len: u64,
        room: u64,
    ) -> Result<(object_store::GetResult, impl Send + use<'_>), ReadError> {
        // Room for the body first: a GET waiting for room holds no request of its bucket.
        let room = self.context.gets.take(room).await;
        let permit = self.requests.acquire().await.map_err(io::Error::other)?;
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        let options = GetOptions {
            range: Some(GetRange::Bounded(offset..offset + len)),
            if_match: (!file.etag.is_empty()).then(|| file.etag.to_string()),
            ..Default::default()
        };
        let changed = |why: String| ReadError::Changed { shard: n, why };
        let result = match self.bucket.store.get_opts(&self.bucket.location(&file.path), options).await {
            Ok(result) => result,
            Err(object_store::Error::Precondition { .. }) => {
                return Err(changed(format!("{} has a new ETag since it was indexed", self.shown(file).display())))
            }
            Err(object_store::Error::NotFound { .. }) => {
                return Err(changed(format!("{} is gone since it was indexed", self.shown(file).display())))
            }
            Err(e) => return Err(ReadError::Io(io::Error::other(format!("{}: {e}", self.shown(file).display())))),
        };
        if let Some(etag) = result.meta.e_tag.as_ref().filter(|e| !file.etag.is_empty() && **e != file.etag) {
            return Err(changed(format!(
                "{} has ETag {etag}, not the indexed {} (rewritten since it was indexed)",
                self.shown(file).display(),
                file.etag
            )));
        }
        if result.meta.size != file.size {
            return Err(changed(format!(
                "{} is {} bytes, not the indexed {}",
                self.shown(file).display(),
                result.meta.size,
                file.size
            )));
        }
        Ok((result, (room, permit)))
    }

    /// The error of a body of `got` bytes where `len` at `offset` were asked for (a retry reads it again).
    pub(super) fn short_body(&self, file: &ShardInfo, offset: u64, len: u64, got: u64) -> ReadError {
        ReadError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{}: {got} bytes at {offset} came back for {len}", self.shown(file).display()),
        ))
    }

    /// Object `file`'s path shown in messages.
    pub(super) fn shown(&self, file: &ShardInfo) -> std::path::PathBuf {
        std::path::PathBuf::from(format!("s3://{}/{}", self.bucket.bucket, self.bucket.location(&file.path)))
    }
}

/// `copy`, registered with `tier` as open (counted, once evicted, until closed); `None` where the tier let
/// the copy go since it was opened.
fn opened(tier: &super::tier::Tier, copy: CopyFile) -> Option<CopyFile> {
    tier.opened(&copy.name, Arc::downgrade(&copy.file) as super::tier::Opened).then_some(copy)
}

/// `memory` cut into `(offset, slice)` parts of `part` bytes (the last one shorter).
pub(super) fn parts_of(memory: &mut [u8], part: u64) -> Vec<(u64, &mut [u8])> {
    memory.chunks_mut(part as usize).enumerate().map(|(k, slice)| (k as u64 * part, slice)).collect()
}

/// Checks copy `path` of object `file` against the index: its size, and the CRC32C of each [`CHUNK_BYTES`]
/// chunk, read one at a time into one buffer (a copy of gigabytes is never read whole into memory). Blocks:
/// call on the blocking pool.
pub(super) fn check_copy(file: &ShardInfo, path: &std::path::Path) -> io::Result<()> {
    let copy = std::fs::File::open(path)?;
    let len = copy.metadata()?.len();
    if len != file.size {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{len} bytes, the object {}", file.size)));
    }
    let mut buffer = vec![0; CHUNK_BYTES.min(file.size) as usize];
    for (k, at) in (0..file.size).step_by(CHUNK_BYTES as usize).enumerate() {
        let piece = &mut buffer[..(file.size - at).min(CHUNK_BYTES) as usize];
        copy.read_exact_at(piece, at)?;
        if file.chunk_crc(k as u64) != Some(batchfs::crc::crc32c(piece)) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("chunk {k} differs from the index")));
        }
    }
    Ok(())
}

/// The first [`CHUNK_BYTES`] chunk of `bytes` (all of `file`) whose CRC32C is not the index's, if any.
pub(super) fn differing_chunk(file: &ShardInfo, bytes: &[u8]) -> Option<u64> {
    if bytes.len() as u64 != file.size {
        return Some(0);
    }
    let chunks = bytes.chunks(CHUNK_BYTES as usize).enumerate();
    chunks.map(|(k, c)| (k as u64, c)).find(|&(k, c)| file.chunk_crc(k) != Some(batchfs::crc::crc32c(c))).map(|c| c.0)
}
