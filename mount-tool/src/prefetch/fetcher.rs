//! The fetcher, a part of its own: one object's body, from the node cache where it holds it (checked on
//! the way in), else from the server through the client, its attempts retried (`retry.rs`) and each body
//! checked against what was announced; then published as the cache keeps it: the verified body (sealed in
//! a memory file the kernel will serve whole under passthrough), or, for `rolling/`'s indexed layout, its
//! records placed at their slots. What it fetched from the server goes into the node cache too. It knows
//! no view, no cache policy and no window: the prefetcher names the [`Request`] and the entry, and does
//! the bookkeeping (`fetch.rs`).

use super::entry::{in_memfd, seal_file, seal_mapped, Content, Entry, Placed, Record};
use super::retry::{other_index, verify, with_retries, Failure};
use super::{ObjectKey, OnDisk, PrefetcherConfig, ReadError};
use crate::buffers::{BufferPool, Filling, Sink};
use crate::client::{ClientError, DynClient, Request, Sent};
use crate::node_cache::NodeCache;
use crate::stats::Stats;
use crate::sync::{Arc, AtomicBool, Ordering};
use batchfs::rolling::FileLayout;
use bytes::Bytes;

/// Fetches objects' bodies for one mount.
pub(super) struct Fetcher {
    client: DynClient,
    /// The retries' settings (`timeout`).
    config: PrefetcherConfig,
    stats: Arc<Stats>,
    /// The node cache (`cache_dir`), if the mount has one.
    node_cache: std::sync::OnceLock<Arc<NodeCache>>,
    /// Bodies go into memory files rather than buffers (the mount uses passthrough).
    memfd_bodies: AtomicBool,
    /// The kernel refused a file of the node cache's disk as a backing file.
    disk_refused: AtomicBool,
}

/// One object to fetch.
pub(super) struct Job {
    /// Which object, for messages.
    pub key: ObjectKey,
    /// What to ask the server for (`None`: nothing can be asked, the fetch fails at once).
    pub request: Option<Request>,
    /// What the server sends for it: the body's size and CRC32C.
    pub sent: Sent,
    /// For `rolling/`'s indexed layout, where the body's records go.
    pub placed: Option<Arc<FileLayout>>,
    /// Where the body may be in the node cache.
    pub on_disk: Option<OnDisk>,
    /// The buffer the admission reserved (reused memory); none: the body goes into a memory file.
    pub buffer: Option<Vec<u8>>,
    /// The idle memory file the admission found for it (see [`BufferPool::lend`]), to receive the body
    /// straight into its pages; none: a fresh one.
    pub recycled: Option<std::fs::File>,
}

/// A fetched object, verified.
pub(super) struct Fetched {
    pub content: Content,
    /// The sealed memory file holding it, for passthrough.
    pub file: Option<Arc<std::fs::File>>,
    /// Read from the node cache, not the server.
    pub from_disk: bool,
}

impl Fetcher {
    /// A fetcher of bodies through `client`, which is told the mount's index (`config.index_id`): a reply
    /// of another is refused at its head ([`crate::client::BatchClient::expect_index`]).
    pub fn new(client: DynClient, config: PrefetcherConfig, stats: Arc<Stats>) -> Self {
        client.expect_index(&config.index_id);
        Fetcher {
            client,
            config,
            stats,
            node_cache: std::sync::OnceLock::new(),
            memfd_bodies: AtomicBool::new(false),
            disk_refused: AtomicBool::new(false),
        }
    }

    /// Keeps verified bodies in `cache` too, and looks there before the network (set once).
    pub fn use_node_cache(&self, cache: Arc<NodeCache>) {
        let _ = self.node_cache.set(cache);
    }

    /// The node cache, if the mount has one.
    pub fn node_cache(&self) -> Option<&Arc<NodeCache>> {
        self.node_cache.get()
    }

    /// Fetches bodies into sealed memory files from now on (when the mount uses passthrough).
    pub fn use_memfds(&self, on: bool) {
        self.memfd_bodies.store(on, Ordering::Relaxed);
    }

    /// Whether bodies go into memory files.
    pub fn memfds(&self) -> bool {
        self.memfd_bodies.load(Ordering::Relaxed)
    }

    /// Opens hand the kernel the node cache's own files no more (it refused one).
    pub fn refuse_disk(&self) {
        self.disk_refused.store(true, Ordering::Relaxed);
    }

    /// Whether opens hand the kernel the node cache's own files: passthrough on, a node cache, and none of
    /// its files refused.
    pub fn serves_from_disk(&self) -> bool {
        self.memfds() && self.node_cache.get().is_some() && !self.disk_refused.load(Ordering::Relaxed)
    }

    /// Fetches `job`'s body: from the node cache if it holds it, else from the server, retried until
    /// `timeout`. A body arriving into a buffer publishes each verified prefix on `entry` (its readers
    /// may read before the rest has come); a failed attempt's buffer is lost, and a retry allocates anew
    /// (the admission's reservation covers either) from `pool`.
    pub async fn fetch(&self, job: Job, entry: &Arc<Entry>, pool: &Arc<BufferPool>) -> Result<Fetched, ReadError> {
        let Job { key, request, sent: meta, placed, on_disk, mut buffer, mut recycled } = job;
        let memfd = buffer.is_none();
        let on_disk = self.node_cache.get().cloned().zip(on_disk);
        // The node cache first: the object, or each of a group's samples, verified on the way in.
        if let Some((nc, pieces)) = on_disk.clone() {
            let found = tokio::task::spawn_blocking(move || from_disk(&nc, &pieces, meta, memfd)).await;
            if let Ok(Some((content, file))) = found {
                return Ok(Fetched { content, file, from_disk: true });
            }
        }
        let client = self.client.clone();
        let filled = entry.clone();
        // A placed file is published only whole: none of its records is where the body has it.
        let early = placed.is_none();
        let into_memfd = self.memfds();
        let stats = self.stats.clone();
        let mounted = (self.config.dataset.clone(), self.config.index_id.clone());
        let fetched = with_retries(&self.config, &self.stats, move |attempt| {
            filled.attempt.store(attempt, Ordering::Release);
            let (client, request, pool, placed) = (client.clone(), request.clone(), pool.clone(), placed.clone());
            let mounted = mounted.clone();
            let stats = stats.clone();
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
            // Short of descriptors, a body meant for a memory file goes into a buffer (within the same
            // charge): opens of it then read through the daemon.
            let or_buffer = |e: std::io::Error| match crate::sys::short_of_descriptors(&e) {
                true => Ok(fill(Vec::new())),
                false => Err(e),
            };
            let into = match (buffer.take(), recycled.take()) {
                (Some(buffer), _) => Ok(fill(buffer)),
                (None, Some(file)) if memfd => Sink::recycled(file, meta.bytes)
                    .or_else(|e| {
                        tracing::debug!(error = %e, "an idle memory file cannot be filled again: a fresh one");
                        Sink::memory_file(meta.bytes)
                    })
                    .or_else(or_buffer),
                (None, _) if memfd => Sink::memory_file(meta.bytes).or_else(or_buffer),
                (None, _) => Ok(fill(Vec::new())),
            };
            async move {
                let into = into.map_err(Failure::Memory)?;
                let request = request.ok_or_else(|| Failure::Fatal(ReadError::NotFound(key.to_string())))?;
                let body = client.fetch_body(&request, attempt, into, meta).await.map_err(|e| match e {
                    ClientError::Corrupt { server, cause } => {
                        Failure::Mismatch(format!("{key} from {server}: {cause}"))
                    }
                    // Said by the reply's head, before any byte: no server may serve the mount's index now.
                    e => other_index((&mounted.0, &mounted.1), &key.to_string(), e),
                });
                let body = match body.and_then(|body| verify(key, &meta, &body).map(|()| body)) {
                    Ok(body) => body,
                    // Not the body the manifest lists (other bytes, or another size), or none at all (no such
                    // batch, file or sample; a range past its end): a server that indexed the dataset again
                    // (restarted over changed files) sends the new index's, and retries until `timeout` would
                    // each get the same.
                    Err(
                        f @ (Failure::Mismatch(_)
                        | Failure::Client(
                            ClientError::Malformed { .. } | ClientError::Status { status: 400 | 404 | 416, .. },
                        )),
                    ) => return Err(changed_or(&client, &mounted, f).await),
                    Err(e) => return Err(e),
                };
                match (body.sink, placed) {
                    (Sink::Buffer(filled), None) => Ok((Content::Bytes(filled.finish()), None)),
                    (Sink::Buffer(filled), Some(layout)) => {
                        let content = place(key, filled.finish(), &layout).map_err(Failure::Fatal)?;
                        if !into_memfd {
                            return Ok((content, None));
                        }
                        // Passthrough will serve it: its memory file now, its records at their slots.
                        match in_memfd(&content) {
                            Ok((content, file)) => Ok((content, Some(file))),
                            Err(e) if crate::sys::short_of_descriptors(&e) => Ok((content, None)),
                            Err(e) => Err(Failure::Memory(e)),
                        }
                    }
                    (Sink::File(m), _) => {
                        let recycled = m.is_recycled();
                        let (bytes, file, mapping) = m.finish().and_then(seal_mapped).map_err(Failure::Memory)?;
                        // Back to the pool once the daemon is done with it, to be filled again.
                        pool.lend(&file, mapping, meta.bytes);
                        if recycled {
                            Stats::add(&stats.recycled_bytes, meta.bytes);
                        }
                        Ok((Content::Bytes(bytes), Some(file)))
                    }
                }
            }
        })
        .await;
        let (content, file) = fetched?;
        if let (Some((nc, pieces)), Content::Bytes(bytes)) = (on_disk, &content) {
            let bytes = bytes.clone();
            tokio::task::spawn_blocking(move || to_disk(&nc, &pieces, &bytes));
        }
        Ok(Fetched { content, file, from_disk: false })
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
    // Only the range: a chunk of a large file kept whole is read alone, checked against its own CRC.
    let within = || -> Option<Vec<u8>> {
        let (whole, offset) = on.within?;
        nc.get_part(whole, offset, meta)
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
        let end = at + piece.sent.bytes as usize;
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
    let layout_error = |message: String| ReadError::Layout(format!("{key}: {message}"));
    let frames = batchfs::rolling::frames_of(&body)
        .ok_or_else(|| layout_error("the batch is not a sequence of TFRecord frames".into()))?;
    let lens: Vec<u64> = frames.iter().map(|&(_, len)| len).collect();
    let positions = layout.positions(key.index, &lens).map_err(|e| layout_error(e.to_string()))?;
    let mut records: Vec<Record> =
        frames.iter().zip(positions).map(|(&(from, len), p)| Record { at: layout.offsets[p], from, len }).collect();
    records.sort_unstable_by_key(|r| r.at);
    Ok(Content::Placed(Placed { bytes: body, records: records.into(), len: layout.len }))
}

/// Why a body was not what the manifest says: the dataset (`mounted`: its name and the index id the mount
/// planned with) indexed again on the server with other files since the mount planned with it (its
/// description says another index: fails at once), or `otherwise`.
async fn changed_or(client: &DynClient, mounted: &(String, String), otherwise: Failure) -> Failure {
    let (dataset, index_id) = mounted;
    if index_id.is_empty() {
        // A server of a release that says no index id: nothing to compare, nothing to ask.
        return otherwise;
    }
    match client.dataset().await {
        Ok(info) => super::changed(dataset, index_id, &info.index_id, "description").map_or(otherwise, Failure::Fatal),
        Err(e @ ClientError::OtherIndex { .. }) => other_index((dataset, index_id), "description", e),
        Err(_) => otherwise,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Failure as Outage, Fault, FaultClient, MemoryClient};
    use batchfs::encode::BatchFormat;
    use std::time::{Duration, Instant};

    const TF: BatchFormat = BatchFormat::Tfrecord;

    /// A fetcher of batches of epoch 0 (`n` of them, of varied sizes) through a client that can fail.
    fn setup(n: usize) -> (tokio::runtime::Runtime, Arc<FaultClient<MemoryClient>>, Fetcher, Vec<Bytes>) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let bodies: Vec<Bytes> =
            (0..n).map(|i| Bytes::from((0..1000 + i * 37).map(|j| (i * 7 + j) as u8).collect::<Vec<u8>>())).collect();
        let b2 = bodies.clone();
        let client = Arc::new(FaultClient::new(MemoryClient::new(move |_, _| b2.clone())));
        let config = PrefetcherConfig { timeout: Duration::from_secs(5), ..Default::default() };
        let fetcher = Fetcher::new(client.clone(), config, Arc::new(Stats::default()));
        (runtime, client, fetcher, bodies)
    }

    fn sent_of(body: &[u8]) -> Sent {
        Sent { bytes: body.len() as u64, crc32c: batchfs::crc::crc32c(body) }
    }

    /// Batch `batch`'s job, into a buffer, found in the node cache if `on_disk`.
    fn job(batch: u64, body: &[u8], on_disk: bool) -> Job {
        let sent = sent_of(body);
        Job {
            key: crate::fs::views::epochs::batches::key(0, batch, TF),
            request: Some(Request::Batch { epoch: 0, batch, format: TF }),
            sent,
            placed: None,
            on_disk: on_disk.then(|| OnDisk { pieces: vec![crate::node_cache::Key { sent, id: batch }], within: None }),
            buffer: Some(Vec::new()),
            recycled: None,
        }
    }

    fn fetch(runtime: &tokio::runtime::Runtime, fetcher: &Fetcher, job: Job) -> Result<Fetched, ReadError> {
        let (entry, pool) = (Arc::new(Entry::new(0)), BufferPool::new(1 << 30));
        runtime.block_on(fetcher.fetch(job, &entry, &pool))
    }

    #[test]
    fn a_corrupt_or_short_body_is_fetched_again_never_returned() {
        let (runtime, client, fetcher, bodies) = setup(3);
        client.inner().inject([Fault::Corrupt, Fault::Short]);
        let fetched = fetch(&runtime, &fetcher, job(2, &bodies[2], false)).unwrap();
        assert_eq!(fetched.content.into_bytes(), bodies[2]);
        assert!(!fetched.from_disk && fetched.file.is_none());
        assert_eq!(fetcher.stats.checksum_errors.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn the_node_cache_is_read_first_and_keeps_what_the_server_sent() {
        let (runtime, client, fetcher, bodies) = setup(2);
        let dir = tempfile::tempdir().unwrap();
        let nc = NodeCache::open(dir.path(), 1 << 20, "d").unwrap();
        fetcher.use_node_cache(nc.clone());
        let fetched = fetch(&runtime, &fetcher, job(1, &bodies[1], true)).unwrap();
        assert!(!fetched.from_disk, "not there yet: from the server");
        let deadline = Instant::now() + Duration::from_secs(10);
        while nc.get(crate::node_cache::Key { sent: sent_of(&bodies[1]), id: 1 }).is_none() {
            assert!(Instant::now() < deadline, "the body never reached the node cache");
            std::thread::sleep(Duration::from_millis(10));
        }
        // The server gone: the body comes from the node's disk, checked, into a memory file for passthrough.
        client.fail_next(std::iter::repeat_n(Outage::Unreachable, 100));
        let mut from_disk = job(1, &bodies[1], true);
        from_disk.buffer = None;
        let fetched = fetch(&runtime, &fetcher, from_disk).unwrap();
        assert!(fetched.from_disk && fetched.file.is_some());
        assert_eq!(fetched.content.into_bytes(), bodies[1]);
    }

    /// A file the listing named that the server no longer has (404): where the server's index is another
    /// than the mount's, the dataset was indexed again, and the read says so ([`ReadError::Changed`]);
    /// where it is the mount's, the server's refusal stands.
    #[test]
    fn a_file_gone_from_a_server_of_another_index_is_the_dataset_indexed_again() {
        let (runtime, client, _, _) = setup(1);
        *client.inner().index_id.lock().unwrap() = "0000000000000002".into();
        let gone = |index_id: &str| {
            let config = PrefetcherConfig { index_id: index_id.into(), dataset: "d".into(), ..Default::default() };
            let fetcher = Fetcher::new(client.clone(), config, Arc::new(Stats::default()));
            let file = Request::File { path: "gone.jpg".into(), offset: 0 };
            let job = Job { request: Some(file), ..job(0, b"listed", false) };
            fetch(&runtime, &fetcher, job).map(|_| ()).unwrap_err()
        };
        // A server of a release whose bodies say no index: the description is asked.
        client.inner().index_in_heads.store(false, Ordering::Relaxed);
        let changed = gone("0000000000000001");
        assert!(matches!(&changed, ReadError::Changed { reply, .. } if reply == "description"), "{changed}");
        assert!(matches!(gone("0000000000000002"), ReadError::Refused(_)));
    }

    /// A body whose head says another index than the mount's (the server indexed the dataset again with
    /// other files) fails at once, long before `timeout`, with the dataset indexed again naming the server;
    /// none of its bytes reaches the entry, and it is asked for once, not retried. A mount of the server's
    /// index (its own client: a client keeps the first index it is told) fetches it as ever.
    #[test]
    fn a_body_of_another_index_fails_at_its_head_at_once_naming_the_server() {
        let (runtime, client, _, bodies) = setup(2);
        let mounted = |client: &Arc<FaultClient<MemoryClient>>, index_id: &str| {
            let config = PrefetcherConfig {
                index_id: index_id.into(),
                dataset: "d".into(),
                timeout: Duration::from_secs(60),
                ..Default::default()
            };
            Fetcher::new(client.clone(), config, Arc::new(Stats::default()))
        };
        *client.inner().index_id.lock().unwrap() = "0000000000000002".into();
        let fetcher = mounted(&client, "0000000000000001");
        let (entry, pool) = (Arc::new(Entry::new(0)), BufferPool::new(1 << 30));
        let started = Instant::now();
        let failed = runtime.block_on(fetcher.fetch(job(1, &bodies[1], false), &entry, &pool)).map(|_| ());
        assert!(started.elapsed() < Duration::from_secs(5), "at once, not after the timeout: {:?}", started.elapsed());
        let changed = failed.unwrap_err();
        assert!(
            matches!(&changed, ReadError::Changed { dataset, was, now, reply }
                if dataset == "d" && was == "0000000000000001" && now == "0000000000000002"
                    && reply.ends_with("from memory")),
            "{changed}"
        );
        assert_eq!(client.inner().fetches.load(Ordering::Relaxed), 1, "no retry");
        assert_eq!(fetcher.stats.checksum_errors.load(Ordering::Relaxed), 0, "no byte taken to be checked");
        let read = entry.wait(Some(0..1), Instant::now(), Duration::ZERO);
        assert!(read.is_err(), "no byte reached the entry's readers");
        let (_, own, _, _) = setup(2);
        *own.inner().index_id.lock().unwrap() = "0000000000000002".into();
        let fetched = fetch(&runtime, &mounted(&own, "0000000000000002"), job(1, &bodies[1], false)).unwrap();
        assert_eq!(fetched.content.into_bytes(), bodies[1]);
    }

    #[test]
    fn nothing_to_ask_for_fails_at_once_and_an_outage_after_the_timeout() {
        let (runtime, client, fetcher, bodies) = setup(1);
        let started = Instant::now();
        let nothing = Job { request: None, ..job(0, &bodies[0], false) };
        assert!(matches!(fetch(&runtime, &fetcher, nothing), Err(ReadError::NotFound(_))));
        assert!(started.elapsed() < Duration::from_secs(4), "no retry mends it");
        client.fail_next(std::iter::repeat_n(Outage::Unreachable, 1000));
        let timeout = PrefetcherConfig { timeout: Duration::from_millis(300), ..Default::default() };
        let fetcher = Fetcher::new(client.clone(), timeout, Arc::new(Stats::default()));
        assert!(matches!(fetch(&runtime, &fetcher, job(0, &bodies[0], false)), Err(ReadError::Timeout { .. })));
    }
}
