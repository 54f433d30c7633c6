//! One fetch, from its admission to its publication: the sink it fills (the reserved buffer, whose
//! verified prefixes readers may read before the rest has come, or a memory file the kernel will serve
//! whole under passthrough), its attempts (`retry.rs`), the check against the manifest, and what it
//! publishes: the verified body, sealed in its memory file; or, for `rolling/`'s indexed layout, the
//! body's records placed at their slots (in a sparse memory file under passthrough), checked to fit.
//! Then it counts the bytes, feeds the delivery rate, and on failure drops the entry (its charge with it).

use super::cache::{Admitted, Ask, Prefetching};
use super::entry::{in_memfd, seal_file, Content, Entry, Placed, Record, State};
use super::retry::{verify, with_retries, Failure};
use super::{describe, Object, ObjectKey, OnDisk, Prefetcher, ReadError};
use crate::buffers::{Filling, Sink};
use crate::client::{ClientError, Sent};
use crate::node_cache::NodeCache;
use crate::stats::Stats;
use crate::sync::{Arc, Ordering};
use batchfs::rolling::FileLayout;
use bytes::Bytes;
use std::time::Instant;

impl Prefetcher {
    /// The cache entry of `key`, starting its fetch if it is absent: `(entry, started now)`. A prefetch
    /// (`on_demand == false`) gets `None` when its bytes do not fit; a read evicts or waits for room.
    pub(super) fn get_or_start(
        self: &Arc<Self>,
        key: ObjectKey,
        obj: &Object,
        on_demand: bool,
        deadline: Instant,
    ) -> Result<Option<(Arc<Entry>, bool)>, ReadError> {
        // With passthrough the body goes straight into a memory file: charged, with no buffer. A placed
        // file is made from its body in a buffer.
        let memfd = self.memfd_bodies.load(Ordering::Relaxed) && obj.placed.is_none();
        let cap = if on_demand { u64::MAX } else { self.window.cap() };
        let ask = Ask { charge: obj.charge(), sent: obj.sent.bytes, memfd, on_demand, cap, deadline };
        Ok(match self.cache.admit(key, ask)? {
            None => None,
            Some(Admitted::Joined(entry)) => Some((entry, false)),
            Some(Admitted::Started { entry, buffer, prefetching }) => {
                Stats::add(&self.stats.in_flight, 1);
                self.window.fetch_started();
                self.spawn_fetch(key, obj.clone(), entry.clone(), buffer, prefetching);
                Some((entry, true))
            }
        })
    }

    /// Fetches `obj` (cached under `key` as `entry`, charged already) on the runtime: into `buffer` (the
    /// admission's, reused memory) or, without one, straight into a memory file. A prefetch brings the
    /// guard that counts it in flight, dropped when the fetch ends.
    fn spawn_fetch(
        self: &Arc<Self>,
        key: ObjectKey,
        obj: Object,
        entry: Arc<Entry>,
        mut buffer: Option<Vec<u8>>,
        prefetching: Option<Prefetching>,
    ) {
        let memfd = buffer.is_none();
        let this = self.clone();
        let fetching = entry;
        // What the server is asked for: a chunk of raw/ or a group of shuffled/ has one once its
        // directory's list or its plan is here, as it is for every key a reader or the window names.
        let request = self.request(key);
        let meta = obj.sent;
        let on_disk = self.node_cache.get().cloned().and_then(|nc| self.on_disk(key, &obj).map(|pieces| (nc, pieces)));
        self.runtime.spawn(async move {
            // The node cache first: the object, or each of a group's samples, verified on the way in.
            if let Some((nc, pieces)) = on_disk.clone() {
                let into_memfd = memfd;
                let found = tokio::task::spawn_blocking(move || from_disk(&nc, &pieces, meta, into_memfd)).await;
                if let Ok(Some((content, file))) = found {
                    this.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
                    this.window.fetch_ended(None);
                    drop(prefetching);
                    if let Some(file) = file {
                        Stats::add(&this.stats.passthrough_bytes, content.stored());
                        *fetching.memfd.lock().expect("memfd") = Some(file);
                    }
                    fetching.set(State::Ready(content));
                    this.cache.changed();
                    return;
                }
            }
            let client = this.client.clone();
            let pool = this.cache.pool().clone();
            let filled = fetching.clone();
            let placed = obj.placed.clone();
            // A placed file is published only whole: none of its records is where the body has it.
            let early = placed.is_none();
            let into_memfd = this.memfd_bodies.load(Ordering::Relaxed);
            // The first attempt fills the reserved buffer; one that fails loses it, and a retry
            // allocates anew (the reservation covers either).
            let result = with_retries(&this.config, &this.stats, move |attempt| {
                let client = client.clone();
                let request = request.clone();
                let pool = pool.clone();
                let placed = placed.clone();
                // Readers wait on the entry for each verified prefix of a buffer (not of a memory file,
                // which the kernel serves only whole).
                let fill = |buffer: Vec<u8>| {
                    let entry = Arc::downgrade(&filled);
                    let wake = move || entry.upgrade().iter().for_each(|e| e.verified_more());
                    let home = Some(Arc::downgrade(&pool));
                    let filling = Filling::new(buffer, (meta.bytes, meta.crc32c), home, wake);
                    if early {
                        filled.filling(filling.partial().clone());
                    }
                    Sink::Buffer(filling)
                };
                let into = match buffer.take() {
                    Some(buffer) => Ok(fill(buffer)),
                    None if memfd => Sink::memory_file(meta.bytes),
                    None => Ok(fill(Vec::new())),
                };
                async move {
                    let into = into.map_err(Failure::Memory)?;
                    let request = request.ok_or_else(|| Failure::Fatal(ReadError::NotFound(describe(key))))?;
                    let body = client.fetch_body(&request, attempt, into, meta.bytes).await.map_err(|e| match e {
                        ClientError::Corrupt { server, cause } => {
                            Failure::Mismatch(format!("{} from {server}: {cause}", describe(key)))
                        }
                        e => Failure::Client(e),
                    })?;
                    verify(key, &meta, &body)?;
                    match (body.sink, placed) {
                        (Sink::Buffer(filled), None) => Ok((Content::Bytes(filled.finish()), None)),
                        (Sink::Buffer(filled), Some(layout)) => {
                            let content = place(key, filled.finish(), &layout).map_err(Failure::Fatal)?;
                            if !into_memfd {
                                return Ok((content, None));
                            }
                            // Passthrough will serve it: its memory file now, its records at their slots.
                            let (content, file) = in_memfd(&content).map_err(Failure::Memory)?;
                            Ok((content, Some(file)))
                        }
                        (Sink::File(m), _) => m
                            .finish()
                            .and_then(seal_file)
                            .map(|(b, f)| (Content::Bytes(b), Some(f)))
                            .map_err(Failure::Memory),
                    }
                }
            })
            .await;
            this.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            drop(prefetching);
            this.window.fetch_ended(result.is_ok().then_some(meta.bytes));
            match result {
                Ok((content, file)) => {
                    Stats::add(&this.stats.fetched_bytes, meta.bytes);
                    if let (Some((nc, pieces)), Content::Bytes(bytes)) = (on_disk, &content) {
                        let bytes = bytes.clone();
                        tokio::task::spawn_blocking(move || to_disk(&nc, &pieces, &bytes));
                    }
                    if let Some(file) = file {
                        Stats::add(&this.stats.passthrough_bytes, content.stored());
                        *fetching.memfd.lock().expect("memfd") = Some(file);
                    }
                    fetching.set(State::Ready(content));
                }
                Err(e) => {
                    tracing::warn!(what = %describe(key), error = %e, "fetch failed");
                    fetching.set(State::Failed(e));
                    // Its charge goes back with it.
                    this.cache.failed(key, &fetching);
                }
            }
            this.cache.changed();
        });
    }
}

/// An object's bytes from the node cache: its pieces (the object, or a group's samples) read and checked
/// one by one, or its range of a whole object there; then checked against `meta`; into a sealed memory
/// file for passthrough with `memfd`. `None` when a piece is missing or wrong (then fetched).
fn from_disk(nc: &NodeCache, on: &OnDisk, meta: Sent, memfd: bool) -> Option<(Content, Option<Arc<std::fs::File>>)> {
    let pieces = || -> Option<Vec<u8>> {
        let mut data = Vec::with_capacity(meta.bytes as usize);
        for &piece in &on.pieces {
            data.extend_from_slice(&nc.get(piece)?);
        }
        Some(data)
    };
    let within = || -> Option<Vec<u8>> {
        let (whole, offset) = on.within?;
        let data = nc.get(whole)?;
        data.get(offset as usize..(offset + meta.bytes) as usize).map(<[u8]>::to_vec)
    };
    let data = pieces().or_else(within)?;
    if data.len() as u64 != meta.bytes || batchfs::crc::crc32c(&data) != meta.crc32c {
        return None;
    }
    if !memfd {
        return Some((Content::Bytes(Bytes::from(data)), None));
    }
    let file = crate::sys::memory_file("batchfs-batch", data.len() as u64).ok()?;
    std::io::Write::write_all(&mut &file, &data).ok()?;
    let (bytes, file) = seal_file(file).ok()?;
    Some((Content::Bytes(bytes), Some(file)))
}

/// Files a fetched object's verified bytes into the node cache: whole, or each of a group's samples.
fn to_disk(nc: &NodeCache, on: &OnDisk, bytes: &[u8]) {
    let mut at = 0usize;
    for &piece in &on.pieces {
        let end = at + piece.bytes as usize;
        let Some(data) = bytes.get(at..end) else { return };
        if let Err(e) = nc.put(piece, data) {
            tracing::warn!(error = %e, "node cache: cannot keep an object (the mount goes on without it)");
            return;
        }
        at = end;
    }
}

/// The records of `body` (a verified TFRecord batch) placed by `layout`: each at the slot of its size
/// rank. A body that is not whole frames, or whose records do not fit the slots, is an error that no
/// retry can mend (the server's slot table does not hold this epoch's batch).
fn place(key: ObjectKey, body: Bytes, layout: &FileLayout) -> Result<Content, ReadError> {
    let layout_error = |message: String| ReadError::Layout(format!("{}: {message}", describe(key)));
    let frames = batchfs::rolling::frames_of(&body)
        .ok_or_else(|| layout_error("the batch is not a sequence of TFRecord frames".into()))?;
    let lens: Vec<u64> = frames.iter().map(|&(_, len)| len).collect();
    let positions = layout.positions(key.index, &lens).map_err(|e| layout_error(e.to_string()))?;
    let mut records: Vec<Record> =
        frames.iter().zip(positions).map(|(&(from, len), p)| Record { at: layout.offsets[p], from, len }).collect();
    records.sort_unstable_by_key(|r| r.at);
    Ok(Content::Placed(Placed { bytes: body, records: records.into(), len: layout.len }))
}
