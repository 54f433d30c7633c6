//! The prefetcher and its cache: the objects a mount shows (batches of an epoch in a format, chunks of `raw/`'s files,
//! `rolling/`'s placed files, groups of `shuffled/`'s samples), fetched whole, verified, and kept under a byte budget.
//! It matches on no view: each view describes its objects behind the traits of `prefetch/kinds.rs` (a listing's
//! [`Kind`](kinds::Kind) names its objects, gives them and says how reads of them are followed; its
//! [`Objects`] say what each object is, what to ask the server for and where on the node's disk it may be).
//! This file is the facade, composing the parts (reads, passthrough files, the prefetches the window asks for, the
//! next epoch's objects fetched in the background). Three parts, each with its own tests and knowing none of the
//! others: `prefetch/cache.rs`, the cache (Shuttle's model tests among its tests): its entries under the byte budget,
//! admission (an object charged before its fetch, by a guard that gives the bytes back when the entry is dropped),
//! what to evict and the wait for room; `prefetch/window.rs`, the window (a Shuttle test too): what to keep ahead of
//! each read (with `prefetch/streams.rs`, which finds the readers' streams), the delivery rate and how much may be in
//! flight; `prefetch/fetcher.rs`, the fetcher: one body from the node cache or through the client with retries
//! (`prefetch/retry.rs`), checked, placed or sealed. Its other rooms: `prefetch/entry.rs` is one entry (its state,
//! contents and memory file, and the waits of its readers), `prefetch/fetch.rs` asks the cache to admit an object,
//! runs its fetch and publishes what it brought; what it keeps of the server's answers, shared by the views:
//! `prefetch/listings.rs` the epochs' manifests and the slot table, `prefetch/raw.rs` the directories' lists cut
//! into chunks, `prefetch/shuffled.rs` the sample table and each epoch's per-class plan of `shuffled/`; and
//! [`BufferPool`](crate::buffers::BufferPool) (`buffers/pool.rs`) keeps the byte budget's one ledger and the
//! buffers reused within it.
//!
//! **Bridge.** FUSE worker threads block here (on a condition variable, always with a deadline, since
//! fuser 0.18 ignores FUSE_INTERRUPT); fetches run as tasks on a tokio runtime. No tokio worker ever
//! waits: condition variables are waited on from the FUSE threads (or test threads) only; a task takes
//! the cache's, an entry's or the throughput's mutex for a few instructions at a time, never across an await.
//!
//! **Invariants.**
//! - No byte reaches a reader before it is verified: its whole batch matched the manifest's size and
//!   CRC32C, or (a read of a batch still arriving into a buffer) a checkpoint of the body at or past it
//!   matched, its checkpoints ending at the manifest's size and CRC32C
//!   ([`Partial`](crate::buffers::Partial)). A mismatch is refetched, never returned.
//! - The bytes charged (ready bodies plus reservations for fetches in flight) plus the idle body buffers kept for reuse
//!   never exceed the budget: one ledger, kept by the [`BufferPool`](crate::buffers::BufferPool). A fetch reuses an
//!   idle buffer when there is one; idle buffers it cannot use are freed before any cached batch is evicted. Prefetches
//!   only start when their bytes fit after evicting *consumed* (or stale) batches; otherwise the window narrows
//!   (backpressure). A read that needs a batch evicts consumed batches first, then stale ones, then the least recently
//!   used ready ones, and otherwise waits for room. Batches whose memory file is open in the kernel are never evicted.
//! - A failed fetch keeps retrying with jittered exponential backoff until `timeout` has passed since
//!   it started, then gives up. A reader waits out its own `timeout`, not the fetch's: a reader whose
//!   time is not up when the fetch it joined gives up starts a new one (the failed entry makes way);
//!   a read whose time is up fails with an error (EIO at the FUSE edge).
//!
//! **Lock order** (outermost first; a lock is only taken while holding those before it):
//! `Entry::making` → the cache's entries (`Cache::entries`) → `Entry::state` → `Entry::memfd` →
//! `BufferPool`'s ledger; and `Shuffled::making` → `Shuffled::plans`. The rest are leaves, never held while
//! another is taken: the window's `throughput` (the prefetch cap is read before admission, not under the
//! cache) and `streams`, the listings' `manifests` and `warming`, `raw/`'s directories, `shuffled/`'s `Reads`, the
//! node cache's `evicting` and the stats' feeds. Each condition variable waits releasing only its own mutex (`room` the
//! cache's entries', `changed` an entry's state, `raw/`'s its directories'), with a deadline. A fetch that
//! ends takes the entries' mutex before it notifies `room`, so a read waiting for room never misses it (the
//! Shuttle test that found that lost wakeup runs in CI); a body buffer freed by a reader's last slice wakes
//! nobody, and a waiting read finds it at its next look, within 100 ms. No lock is held across a call to the
//! client, a `block_on`, a backoff sleep or the node cache's disk I/O; the one lock held across I/O is an
//! entry's `making`, while its memory file is written (a second opener of the same entry waits for that copy,
//! not for the network). Under the cache lock, evictions may close memory files, unmap bodies and hand
//! buffers back to the pool (frees, never waits).
//!
//! **Window.** [`StreamTracker`] (in `prefetch/streams.rs`) turns the batches read of each listing into
//! streams, whoever reads them: the first read of an epoch gets the full window (`prefetch` batches, more
//! when small: [`PrefetcherConfig::prefetch_bytes`]) at once, a rank or range shard gets its own stream at
//! its second read, random reads start nothing, and a window that runs past the end of an epoch continues
//! into the next one (whose manifest is then fetched in the background).

use crate::client::DynClient;
use crate::node_cache::NodeCache;
use crate::options::MountOptions;
use crate::stats::Stats;
use crate::sync::{Arc, Ordering};
use batchfs::api::{Manifest, SlotTable};
use batchfs::encode::BatchFormat;
use batchfs::rolling::FileLayout;
use bytes::Bytes;
use std::time::{Duration, Instant};
pub use streams::{StreamTracker, Target};
use thiserror::Error;
pub use window::prefetch_cap;

mod cache;
mod entry;
mod fetch;
mod fetcher;
pub mod kinds;
mod listings;
mod raw;
mod retry;
mod shuffled;
mod streams;
mod window;
use cache::{Cache, Limits};
use entry::{Content, Entry};
use fetcher::Fetcher;
pub use kinds::{Listing, Object, Objects, OnDisk};
use listings::Listings;
pub(crate) use listings::NextEpoch;
pub(crate) use raw::Raw;
use raw::RawDirs;
use retry::{with_retries, Failure};
pub use shuffled::{ClassPlan, ShuffledConfig, WINDOW_GROUPS, WINDOW_GROWTH};
use window::Window;

/// One object of the cache: object `index` of a listing (a batch of an epoch, a chunk of a file of `raw/`,
/// a group of samples of `shuffled/`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ObjectKey {
    pub listing: Listing,
    pub index: u64,
}

/// Names the object in messages, as its view does.
impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.listing.kind.describe(self.listing, self.index))
    }
}

/// The largest object an open takes from the node cache's own file ([`Prefetcher::disk_backing`]): the open
/// checks it whole, which a larger one would hold up. Larger ones read through the daemon, each `raw/`
/// chunk checked as it is read.
pub const DISK_WHOLE_MAX: u64 = 64 << 20;

/// How often a read waiting past its `timeout` while bytes come looks whether an attempt of its fetch
/// failed (which ends it: bytes that fail their checksum are no busy link's).
const ATTEMPT_LOOK: Duration = Duration::from_millis(100);

/// Prefetcher settings, from the mount's options (`options.rs`, documented in `docs/CONFIGURATION.md`).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefetcherConfig {
    /// Batches kept cached or in flight ahead of each reader stream (0: no prefetch).
    pub prefetch: usize,
    /// The window holds at least this many bytes of batches (by the listing's mean batch size): more than
    /// `prefetch` batches when they are small, so that small batches get a window as deep in bytes (and in
    /// time to arrive) as larger ones. 0: `prefetch` batches only.
    pub prefetch_bytes: u64,
    /// Byte budget of the cache, in-flight fetches included.
    pub cache_bytes: u64,
    /// How long a read waits out failures before it fails.
    pub timeout: Duration,
    /// Reader streams tracked at once.
    pub max_streams: usize,
    /// Largest stride recognized as a stream (e.g. the number of DDP ranks).
    pub max_stride: u64,
    /// Bytes of prefetches in flight at once, all streams together (one prefetch may always run); more
    /// wait until some end. Reads that need a batch never wait for this, so they do not queue behind a
    /// whole window of prefetches. Sized like a bandwidth-delay product, not a batch count, so small
    /// batches still get deep windows.
    pub max_prefetch_bytes: u64,
    /// The last epoch a window may run on into (the epochs a job reads; `u64::MAX`: any).
    pub last_epoch: u64,
    /// A cached batch nobody read or asked for in this long may make room for prefetches even though
    /// no reader consumed it (a window that ran past where its reader stopped).
    pub stale_after: Duration,
    /// The client abandons a response with no byte for this long: prefetches in flight are kept to what
    /// the measured delivery rate brings in half of it (see [`prefetch_cap`]).
    pub stall_timeout: Duration,
    /// The span of epochs `(first_epoch, epochs)` whose TFRecord batches `rolling/`'s indexed layout
    /// holds (the slot table asked of the server).
    pub rolling: (u64, u64),
    /// The plan and share of `shuffled/`.
    pub shuffled: ShuffledConfig,
    /// The content id of the dataset's index the mount planned with ([`batchfs::api::DatasetInfo::index_id`]; empty:
    /// none known). A manifest, directory listing, sample table or slot table of another, or a body that is not
    /// what was listed from a server whose index now has another, fails at once ([`ReadError::Changed`]).
    pub index_id: String,
    /// The dataset's name, for messages.
    pub dataset: String,
}

impl From<&MountOptions> for PrefetcherConfig {
    fn from(o: &MountOptions) -> Self {
        PrefetcherConfig {
            prefetch: o.prefetch,
            prefetch_bytes: o.prefetch_bytes,
            cache_bytes: o.cache,
            timeout: o.timeout,
            max_streams: 64,
            max_stride: 64,
            max_prefetch_bytes: o.max_prefetch_bytes,
            // A window runs on into the next epoch only within the epochs the job reads (from
            // `first_epoch` in rolling/).
            last_epoch: (o.first_epoch + o.epochs).saturating_sub(1),
            stale_after: o.stale_after,
            stall_timeout: o.stall_timeout,
            // rolling/ spans at most what a slot table covers, and starts over after it.
            rolling: (o.first_epoch, o.epochs.min(batchfs::rolling::MAX_SPAN)),
            shuffled: ShuffledConfig { plan: o.plan, share: o.share },
            index_id: String::new(),
            dataset: String::new(),
        }
    }
}

/// The mount's defaults (declared once, in `options.rs`), with no last epoch and a one-epoch span of
/// `rolling/`.
impl Default for PrefetcherConfig {
    fn default() -> Self {
        let config = PrefetcherConfig::from(&MountOptions::default());
        PrefetcherConfig { last_epoch: u64::MAX, rolling: (0, 1), ..config }
    }
}

/// Why a read cannot be served.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ReadError {
    #[error("{0} does not exist")]
    NotFound(String),
    #[error("gave up after {after:?}: {last}")]
    Timeout { after: Duration, last: String },
    #[error("the server refused: {0}")]
    Refused(String),
    #[error("the cache budget ({budget} bytes) cannot hold {what} ({size} bytes); raise `cache`")]
    CacheTooSmall { what: String, size: u64, budget: u64 },
    #[error("cannot make a backing file for {0}")]
    Backing(String),
    /// A batch that the slots of `rolling/`'s indexed layout cannot hold (a server whose slot table does
    /// not match its batches): no retry mends it.
    #[error("cannot place {0} in rolling/'s indexed layout")]
    Layout(String),
    /// The server's dataset was indexed again with other files since the mount planned with it: its
    /// batches, files and samples are no longer the ones listed (no retry mends it; the mount must be made
    /// again). `reply` is what said the other index (its manifest of an epoch, a listing, a table).
    #[error(
        "dataset {dataset:?} was indexed again with other files since this mount began: the mount lists index \
         {was}, the server's {reply} is of index {now}; what it serves is no longer what this mount lists: \
         unmount and mount again to read it"
    )]
    Changed { dataset: String, was: String, now: String, reply: String },
}

impl PrefetcherConfig {
    /// [`ReadError::Changed`] where `now`, the index id of the server's `reply`, is not the mount's (both
    /// known).
    pub fn changed(&self, now: &str, reply: &str) -> Option<ReadError> {
        changed(&self.dataset, &self.index_id, now, reply)
    }
}

/// [`ReadError::Changed`] where `now`, the index id of the server's `reply` about `dataset`, is not `was`,
/// the mount's (both known: an empty id is a server's before index ids, or a mount that has none).
pub fn changed(dataset: &str, was: &str, now: &str, reply: &str) -> Option<ReadError> {
    (!was.is_empty() && !now.is_empty() && now != was).then(|| ReadError::Changed {
        dataset: dataset.to_owned(),
        was: was.to_owned(),
        now: now.to_owned(),
        reply: reply.to_owned(),
    })
}

/// The prefetcher and cache of one mount.
pub struct Prefetcher {
    client: DynClient,
    runtime: tokio::runtime::Handle,
    config: PrefetcherConfig,
    /// The entries under the byte budget, with admission and the buffer pool.
    cache: Cache,
    listings: Listings,
    /// The directories of `raw/` listed so far.
    raw: RawDirs,
    /// The sample table and the plans of `shuffled/`.
    shuffled: shuffled::Shuffled,
    /// Fetches bodies: from the node cache, or the server with retries.
    fetcher: Fetcher,
    /// What to fetch ahead of each reader, and how much may be in flight.
    window: Window,
    pub stats: Arc<Stats>,
}

impl Prefetcher {
    /// A prefetcher fetching through `client` on `runtime`.
    pub fn new(client: DynClient, runtime: tokio::runtime::Handle, config: PrefetcherConfig) -> Arc<Self> {
        let stats = Arc::new(Stats::default());
        let fetcher = Fetcher::new(client.clone(), config.clone(), stats.clone());
        Arc::new(Prefetcher {
            client,
            runtime,
            cache: Cache::new(
                Limits { budget: config.cache_bytes, stale_after: config.stale_after, timeout: config.timeout },
                stats.clone(),
            ),
            listings: Listings::new(),
            raw: RawDirs::default(),
            shuffled: Default::default(),
            fetcher,
            window: Window::new(&config, stats.clone()),
            stats,
            config,
        })
    }

    /// Keeps verified objects in `cache` too, and looks there before the network (set once, before the
    /// first read).
    pub fn use_node_cache(&self, cache: Arc<NodeCache>) {
        self.fetcher.use_node_cache(cache);
    }

    /// The client it fetches through.
    pub fn client(&self) -> DynClient {
        self.client.clone()
    }

    /// The node cache, if the mount has one.
    pub fn node_cache(&self) -> Option<&Arc<NodeCache>> {
        self.fetcher.node_cache()
    }

    /// Fetches bodies into sealed memory files from now on, ready to be handed to the kernel (when the
    /// mount uses passthrough): no buffer in between, and no copy at open.
    pub fn fetch_into_memfds(&self, on: bool) {
        self.fetcher.use_memfds(on);
    }

    /// Whether opens hand the kernel the node cache's own files (passthrough on, a node cache, none of its
    /// files refused): what is there need not be fetched into memory for them.
    pub fn serves_from_disk(&self) -> bool {
        self.fetcher.serves_from_disk()
    }

    /// The kernel refused a file of the node cache's disk: opens copy what is there into memory from now on.
    pub fn refuse_disk(&self) {
        self.fetcher.refuse_disk();
    }

    /// Whether an open of the object `sent` would get the node cache's file ([`Prefetcher::disk_backing`]):
    /// the node cache holds it (not checked) and it is at most [`DISK_WHOLE_MAX`].
    pub fn on_disk(&self, key: crate::node_cache::Key) -> bool {
        key.sent.bytes <= DISK_WHOLE_MAX && self.fetcher.node_cache().is_some_and(|nc| nc.contains(key))
    }

    /// The manifest of `epoch` in `format` (cached; fetched with retries up to `timeout`). Blocks: call
    /// from a FUSE thread, never from the runtime.
    pub fn manifest(&self, epoch: u64, format: BatchFormat) -> Result<Arc<Manifest>, ReadError> {
        if let Some(m) = self.listings.manifest(epoch, format) {
            return Ok(m);
        }
        self.runtime.block_on(self.fetch_manifest(epoch, format))
    }

    /// The slot table of `rolling/`'s indexed layout for [`PrefetcherConfig::rolling`] (cached; fetched
    /// once, with retries up to `timeout`). Blocks like [`Prefetcher::manifest`].
    pub fn slot_table(&self) -> Result<Arc<SlotTable>, ReadError> {
        match self.listings.slot_table() {
            Some(t) => Ok(t),
            None => self.runtime.block_on(self.fetch_slot_table()),
        }
    }

    /// [`Prefetcher::slot_table`], awaited: where a fetch of the layout's file needs it. A worker that
    /// took over a mount holds none yet, and an open the kernel sends it again (its lookup answered by the
    /// worker before) comes without the lookup that fetched it.
    pub(crate) async fn fetch_slot_table(&self) -> Result<Arc<SlotTable>, ReadError> {
        if let Some(t) = self.listings.slot_table() {
            return Ok(t);
        }
        let (first_epoch, epochs) = self.config.rolling;
        let client = self.client.clone();
        let table = with_retries(&self.config, &self.stats, move |_| {
            let client = client.clone();
            async move { client.slot_table(first_epoch, epochs).await.map_err(Failure::Client) }
        })
        .await?;
        // Slots of another index's batches: not the batches this mount lists.
        if let Some(changed) = self.config.changed(&table.index_id, "slot table of rolling/") {
            return Err(changed);
        }
        Ok(self.listings.put_slot_table(table))
    }

    /// The layout of `rolling/`'s indexed file of batch `batch` (fetching the slot table if need be).
    pub fn file_layout(&self, batch: u64) -> Result<FileLayout, ReadError> {
        let table = self.slot_table()?;
        let slots =
            table.batches.get(batch as usize).ok_or_else(|| ReadError::NotFound(format!("rolling batch {batch}")))?;
        Ok(FileLayout::new(batch, slots))
    }

    /// What warming epoch `epoch` in `format` needs, without blocking or marking anything used: its
    /// manifest if here, and the format of index twins to fetch too (a reader of this epoch's DALI index
    /// twins reads all of the next epoch's at its pipeline build).
    pub(crate) fn next_epoch_manifests(&self, epoch: u64, format: BatchFormat) -> NextEpoch {
        self.listings.next_epoch(epoch, format)
    }

    /// The slot table of `rolling/`'s indexed layout, if fetched (never blocks).
    pub(crate) fn cached_slot_table(&self) -> Option<Arc<SlotTable>> {
        self.listings.slot_table()
    }

    /// Fetches the manifest of `epoch` in `format` (with retries up to `timeout`) and caches it.
    pub(crate) async fn fetch_manifest(&self, epoch: u64, format: BatchFormat) -> Result<Arc<Manifest>, ReadError> {
        let client = self.client.clone();
        let manifest = with_retries(&self.config, &self.stats, move |_| {
            let client = client.clone();
            async move { client.manifest(epoch, format).await.map_err(Failure::Client) }
        })
        .await?;
        // An epoch not listed before, planned by a server of another index: not this mount's dataset.
        if let Some(changed) = self.config.changed(&manifest.index_id, &format!("manifest of epoch {epoch}")) {
            return Err(changed);
        }
        Ok(self.listings.put_manifest(manifest))
    }

    /// Reads `[offset, offset + size)` of a batch file. Blocks until those bytes are verified (the whole batch, or,
    /// while it arrives into a buffer, its prefix up to a checkpoint past them).
    /// `owner` identifies the reading process (see [`StreamTracker`]).
    pub fn read(self: &Arc<Self>, key: ObjectKey, offset: u64, size: u32, owner: u32) -> Result<Bytes, ReadError> {
        self.read_stalled(key, offset, size, owner).map(|(bytes, _)| bytes)
    }

    /// [`Prefetcher::read`], and whether the read stalled: it waited for its bytes, or had to start their
    /// fetch (a window that keeps ahead of its reads has them cached by then).
    pub fn read_stalled(
        self: &Arc<Self>,
        key: ObjectKey,
        offset: u64,
        size: u32,
        owner: u32,
    ) -> Result<(Bytes, bool), ReadError> {
        let (objects, obj) = self.locate(key)?;
        let len = obj.size();
        if offset >= len || size == 0 {
            return Ok((Bytes::new(), false));
        }
        let end = (offset + u64::from(size)).min(len);
        let (entry, content, early, stalled) = self.wait_for(key, &obj, &objects, owner, Some(offset..end))?;
        let bytes = content.into_bytes();
        if end == len {
            entry.consumed.store(true, Ordering::Relaxed);
        }
        Stats::add(&self.stats.reads, 1);
        Stats::add(&self.stats.bytes_served, end - offset);
        if early {
            Stats::add(&self.stats.early_reads, 1);
        }
        Ok((bytes, stalled))
    }

    /// The objects of `key`'s listing, as its view describes them, and what `key` is.
    fn locate(&self, key: ObjectKey) -> Result<(Arc<dyn Objects>, Object), ReadError> {
        let objects = key.listing.kind.objects(self, key.listing)?;
        let obj = objects.object(key.index).ok_or_else(|| ReadError::NotFound(key.to_string()))?;
        Ok((objects, obj))
    }

    /// Waits until batch `key` is verified and cached (or, with `range`, until those of its bytes are
    /// verified, which may be before the rest has arrived), starting its fetch if needed and the window of
    /// the stream it belongs to; counts the hit or miss and any stall. Returns the body (or the range)
    /// and whether it came before the whole body, and whether the read stalled (waited, or started the
    /// fetch).
    fn wait_for(
        self: &Arc<Self>,
        key: ObjectKey,
        obj: &Object,
        objects: &Arc<dyn Objects>,
        owner: u32,
        range: Option<std::ops::Range<u64>>,
    ) -> Result<(Arc<Entry>, Content, bool, bool), ReadError> {
        let started = Instant::now();
        let own = started + self.config.timeout;
        let mut deadline = own;
        let (entry, fresh) =
            self.get_or_start(key, (objects, obj), true, deadline)?.expect("on-demand reads always get an entry");
        entry.touched.store(self.cache.clock(), Ordering::Relaxed);
        self.prefetch_after(key, objects, owner);
        let (mut entry, mut fresh) = (entry, fresh);
        // The client's bytes received, and the attempt the fetch was at, when the read last looked.
        let mut heard = (self.client.received(), 0);
        // Waiting past `timeout` (bytes came): the fetch's attempts looked at every [`ATTEMPT_LOOK`].
        let mut past = false;
        let (body, waited, early) = loop {
            let wake = if past { deadline.min(Instant::now() + ATTEMPT_LOOK) } else { deadline };
            match entry.wait(range.clone(), wake, self.config.timeout) {
                // The fetch this read joined gave up, its own `timeout` after *it* started; this reader's
                // time is its own: a new fetch (the failed entry makes way for it) within its `timeout`
                // (not a deadline waited on past it: a fetch started then would fail after it, and the
                // read, waiting on while other bodies' bytes come, would start one after another).
                Err(ReadError::Timeout { .. }) if entry.is_failed() && Instant::now() < own => {
                    (entry, fresh) = self
                        .get_or_start(key, (objects, obj), true, deadline)?
                        .expect("on-demand reads always get an entry");
                }
                // `timeout` passed with the fetch still on its way and bytes coming all along: the link
                // is busy (a narrow one, shared with the window's fetches), the server not unreachable.
                // The read waits another `timeout`, as long as they keep coming and none of its fetch's
                // attempts fails from then on (bytes that fail their checksum are no busy link's; an attempt
                // given up before, passed over on a busy link, is no reason), for the fetch it waits on: one
                // that fails ends the read (its retries end `timeout` after its first attempt, and a stream
                // that gets none of the bytes is given up by the client, `stall_timeout`).
                // Past `timeout`, an attempt of its fetch that failed ends the read.
                Err(e @ ReadError::Timeout { .. }) if past && entry.attempt.load(Ordering::Acquire) != heard.1 => {
                    return Err(e);
                }
                // A look at the attempts, not the deadline.
                Err(ReadError::Timeout { .. }) if past && !entry.is_failed() && Instant::now() < deadline => {}
                Err(ReadError::Timeout { .. }) if !entry.is_failed() && self.client.received() != heard.0 => {
                    heard = (self.client.received(), entry.attempt.load(Ordering::Acquire));
                    deadline = Instant::now() + self.config.timeout;
                    past = true;
                }
                other => break other?,
            }
        };
        let s = &self.stats;
        // A hit found its batch cached or already being fetched; a miss had to start the fetch.
        Stats::add(if fresh { &s.misses } else { &s.hits }, 1);
        if fresh {
            tracing::debug!(what = %key, owner, "miss: fetched on demand");
        }
        if waited || fresh {
            Stats::add(&s.stalls, 1);
            Stats::add(&s.stall_ns, started.elapsed().as_nanos() as u64);
        }
        Ok((entry, body, early, waited || fresh))
    }

    /// The verified bytes of `key` in a sealed memory file, for the kernel to serve reads and mmap faults
    /// from without asking the daemon (FUSE passthrough). Blocks like [`Prefetcher::read`] until the batch
    /// is cached. The file replaces the batch's body buffer (its pages are the cache's copy from now on)
    /// and keeps the batch in the cache, charged to the budget, while anyone holds the returned handle.
    pub fn backing_file(self: &Arc<Self>, key: ObjectKey, owner: u32) -> Result<Arc<std::fs::File>, ReadError> {
        let result = (|| {
            let (objects, obj) = self.locate(key)?;
            let (entry, body, _, _) = self.wait_for(key, &obj, &objects, owner, None)?;
            // The kernel serves the whole file from here on: its bytes (a placed file's records) count
            // as served, once.
            if !entry.handed.swap(true, Ordering::Relaxed) {
                Stats::add(&self.stats.bytes_served, body.stored());
            }
            entry.backing(body).map_err(|e| ReadError::Backing(format!("{key}: {e}")))
        })();
        if let Ok((_, made)) = &result {
            Stats::add(&self.stats.passthrough_opens, 1);
            Stats::add(&self.stats.passthrough_bytes, *made);
        }
        result.map(|(file, _)| file)
    }

    /// The node cache's file of the object `whole` (a `raw/` file kept there whole, by warming or by a
    /// fetch of its one chunk; a `shuffled/` sample, which is its file), checked, for the kernel to serve
    /// straight from the disk: neither read into memory nor fetched, and no window started (a reader whose
    /// next files are not there misses once, and the window starts from that read). `None` without a node
    /// cache, when it does not hold the object right (a wrong file is removed), or for an object larger
    /// than [`DISK_WHOLE_MAX`].
    pub fn disk_backing(&self, whole: crate::node_cache::Key) -> Option<Arc<std::fs::File>> {
        if whole.sent.bytes > DISK_WHOLE_MAX {
            return None;
        }
        let file = self.fetcher.node_cache()?.open_checked(whole)?;
        Stats::add(&self.stats.passthrough_opens, 1);
        Stats::add(&self.stats.hits, 1);
        Stats::add(&self.stats.bytes_served, whole.sent.bytes);
        Some(Arc::new(file))
    }

    /// Starts the window of the stream this read belongs to: what its view asks for after this object
    /// (`raw/`'s other DALI indexes), what the [`Window`] keeps ahead of it, in this listing and on into
    /// the next epoch's, whose objects a background task fetches (once, however many reads ask) if they
    /// are not at hand.
    fn prefetch_after(self: &Arc<Self>, key: ObjectKey, objects: &Arc<dyn Objects>, owner: u32) {
        let follow = key.listing.kind.follow(key.listing);
        if !self.window.applies_to(follow) {
            return;
        }
        let also: Vec<Target> =
            objects.also_after(key.index).into_iter().map(|index| Target { listing: key.listing, index }).collect();
        self.start_prefetches(&also, objects);
        let window::Ahead { here, next, firsts } = self.window.ahead(owner, key.listing, key.index, objects, follow);
        if follow.into_next_epoch {
            self.cache.read_in_epoch(key, &firsts);
        }
        if !self.start_prefetches(&here, objects) {
            return;
        }
        // The window runs into the next epoch: its objects may not be at hand yet, and fetching them must
        // not hold up this read.
        let Some(&Target { listing: next_listing, .. }) = next.first() else { return };
        if next_listing.epoch > self.config.last_epoch {
            return;
        }
        let kinds::Warming { cached, whole } = next_listing.kind.warming(self, next_listing);
        if let (Some(objects), true) = (&cached, whole.is_empty()) {
            self.start_prefetches(&next, objects);
            return;
        }
        // One task per next listing: the reads near an epoch's end would each start one, and each would
        // fetch the same objects. Reads after it ends find them at hand.
        if !self.listings.start_warming(next_listing, &next) {
            return;
        }
        let this = self.clone();
        self.runtime.spawn(async move {
            // Starting a prefetch takes the cache lock only briefly and never waits.
            let objects = match cached {
                Some(objects) => Ok(objects),
                None => next_listing.kind.fetch(this.clone(), next_listing).await,
            };
            let objects = objects.ok();
            if let Some(objects) = &objects {
                this.start_prefetches(&next, objects);
            }
            for listing in whole {
                if let Ok(objects) = listing.kind.fetch(this.clone(), listing).await {
                    let all: Vec<Target> = (0..objects.count()).map(|index| Target { listing, index }).collect();
                    this.start_prefetches(&all, &objects);
                }
            }
            let meanwhile = this.listings.warmed(next_listing);
            if let Some(objects) = &objects {
                this.start_prefetches(&meanwhile, objects);
            }
        });
    }

    /// Starts the prefetch of each target (of the listing of `objects`) not cached or in flight, in order,
    /// until one finds no room (the window narrows until readers consume what is cached); false then.
    fn start_prefetches(self: &Arc<Self>, targets: &[Target], objects: &Arc<dyn Objects>) -> bool {
        for target in targets {
            let key = ObjectKey { listing: target.listing, index: target.index };
            let Some(obj) = objects.object(key.index) else { continue };
            match self.get_or_start(key, (objects, &obj), false, Instant::now()) {
                Ok(Some((_, true))) => Stats::add(&self.stats.prefetches, 1),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return false,
            }
        }
        true
    }

    /// Starts the prefetch of each target of the listing of `objects` not cached or in flight, in order, until
    /// one finds no room: for a view that keeps windows of its own (`shuffled/`'s classes). Nothing without
    /// prefetch.
    pub(crate) fn prefetch(self: &Arc<Self>, targets: &[Target], objects: &Arc<dyn Objects>) {
        if self.config.prefetch != 0 {
            self.start_prefetches(targets, objects);
        }
    }

    /// `key` leaves the cache now (a group of samples all read: nobody reads it again).
    pub(crate) fn forget(&self, key: ObjectKey) {
        self.cache.forget(key);
    }

    /// A reader closed its last handle of `key`: the batch goes first when room is needed.
    pub fn closed(&self, key: ObjectKey) {
        self.cache.closed(key);
    }

    /// Bytes held or reserved now, idle reusable buffers included (never above the budget).
    pub fn cache_used(&self) -> u64 {
        self.cache.used()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Failure, Fault, FaultClient, MemoryClient, Sent};
    use crate::fs::views::epochs::batches::{self, Batches};
    use crate::fs::views::raw::chunks::{self, CHUNKS};
    use crate::node_cache::NodeCache;
    use kinds::Kind;

    type Client = FaultClient<MemoryClient>;
    use proptest::prelude::*;

    /// A prefetcher of dataset "d" with index id `mounted`, over a client serving `files` (each
    /// `body`) whose index id is `served`; `timeout` 30 s, so that what fails at once is told apart.
    pub(super) fn of_files(
        files: &[&str],
        body: &'static [u8],
        (served, mounted): (&str, &str),
    ) -> (tokio::runtime::Runtime, Arc<MemoryClient>, Arc<Prefetcher>) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|_, _| vec![]);
        client.files = files.iter().map(|p| (p.to_string(), Bytes::from_static(body))).collect();
        *client.index_id.lock().unwrap() = served.into();
        let client = Arc::new(client);
        let config = PrefetcherConfig {
            index_id: mounted.into(),
            dataset: "d".into(),
            timeout: Duration::from_secs(30),
            ..Default::default()
        };
        let p = Prefetcher::new(client.clone(), runtime.handle().clone(), config);
        (runtime, client, p)
    }

    const TF: BatchFormat = BatchFormat::Tfrecord;
    const L2: Listing = batches::listing(2, TF);

    impl ObjectKey {
        /// Batch `batch` of `epoch` in `format`.
        fn batch(epoch: u64, batch: u64, format: BatchFormat) -> Self {
            batches::key(epoch, batch, format)
        }
    }

    impl Prefetcher {
        fn read_as0(self: &Arc<Self>, key: ObjectKey, offset: u64, size: u32) -> Result<Bytes, ReadError> {
            self.read(key, offset, size, 0)
        }

        /// `raw/`'s read of file `file` of directory `dir`.
        fn read_file(
            self: &Arc<Self>,
            dir: u32,
            file: u64,
            offset: u64,
            size: u32,
            owner: u32,
        ) -> Result<Bytes, ReadError> {
            chunks::read_file(self, (dir, file), offset, size, owner)
        }
    }

    /// An epoch's manifest as the epoch folders describe it to the prefetcher.
    fn objects_of(manifest: Arc<Manifest>) -> Arc<dyn Objects> {
        Arc::new(Batches(manifest))
    }

    /// A runtime on its own threads and an in-memory dataset of `n` batches of varied sizes.
    fn setup(
        n: usize,
        config: PrefetcherConfig,
    ) -> (tokio::runtime::Runtime, Arc<Client>, Arc<Prefetcher>, Vec<Bytes>) {
        setup_sized(n, 1000, 1, config)
    }

    /// Like [`setup`], with batch `i` of `base + ((i * 37) % 300) * step` bytes.
    fn setup_sized(
        n: usize,
        base: usize,
        step: usize,
        config: PrefetcherConfig,
    ) -> (tokio::runtime::Runtime, Arc<Client>, Arc<Prefetcher>, Vec<Bytes>) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let bodies: Vec<Bytes> = (0..n)
            .map(|i| Bytes::from((0..base + (i * 37) % 300 * step).map(|j| (i * 7 + j) as u8).collect::<Vec<u8>>()))
            .collect();
        let b2 = bodies.clone();
        let client = Arc::new(FaultClient::new(MemoryClient::new(move |_, _| b2.clone())));
        let p = Prefetcher::new(client.clone(), runtime.handle().clone(), config);
        (runtime, client, p, bodies)
    }

    fn key(batch: u64) -> ObjectKey {
        ObjectKey::batch(0, batch, TF)
    }

    /// `rolling/`'s indexed file read by a prefetcher that holds no slot table yet (a worker that took
    /// over a mount: an open the kernel sends it again comes without the lookup that fetched the table)
    /// fetches the table and places the batch: it failed with "the slot table is not here" (EIO).
    #[test]
    fn an_indexed_rolling_file_read_before_the_slot_table_was_fetched_fetches_it() {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let bodies: Vec<Bytes> = (0..4usize)
            .map(|b| {
                let mut out = Vec::new();
                for r in 0..5 {
                    batchfs::tfrecord::encode_record(&vec![b as u8 + r as u8; 100 + r * 37 + b * 11], &mut out);
                }
                Bytes::from(out)
            })
            .collect();
        let client = Arc::new(FaultClient::new(MemoryClient::new(move |_, _| bodies.clone())));
        let config = PrefetcherConfig { prefetch: 0, ..Default::default() };
        let fresh = Prefetcher::new(client.clone(), runtime.handle().clone(), config.clone());
        let reference = Prefetcher::new(client, runtime.handle().clone(), config);
        reference.slot_table().unwrap();
        for batch in [1, 3] {
            let key = crate::fs::views::rolling::placed::key(0, batch);
            let want = reference.read_as0(key, 0, 1 << 20).unwrap();
            assert_eq!(want.len() as u64, reference.file_layout(batch).unwrap().len);
            assert_eq!(fresh.read_as0(key, 0, 1 << 20).unwrap(), want, "batch {batch}");
        }
        let fresh = Prefetcher::new(fresh.client.clone(), runtime.handle().clone(), fresh.config.clone());
        let key = crate::fs::views::rolling::placed::key(0, 2);
        assert!(fresh.backing_file(key, 0).is_ok(), "a passthrough open, likewise");
    }

    /// A slot table of another index than the mount's (the dataset indexed again with other files) fails
    /// at once and is not kept: `rolling/`'s twins and indexed files are never laid out by another index's
    /// batches. The mount's index's table is kept.
    #[test]
    fn a_slot_table_of_another_index_fails_at_once_and_is_not_kept() {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut body = Vec::new();
        batchfs::tfrecord::encode_record(&[7; 100], &mut body);
        let client = MemoryClient::new(move |_, _| vec![Bytes::from(body.clone())]);
        *client.index_id.lock().unwrap() = "0000000000000002".into();
        let client = Arc::new(client);
        let config = PrefetcherConfig {
            index_id: "0000000000000001".into(),
            dataset: "d".into(),
            timeout: Duration::from_secs(30),
            ..Default::default()
        };
        let p = Prefetcher::new(client.clone(), runtime.handle().clone(), config);
        let started = Instant::now();
        let err = p.file_layout(0).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5), "at once, not after timeout");
        assert!(matches!(&err, ReadError::Changed { now, .. } if now == "0000000000000002"), "{err}");
        assert!(p.cached_slot_table().is_none(), "nothing of it kept");
        *client.index_id.lock().unwrap() = "0000000000000001".into();
        assert!(p.file_layout(0).is_ok() && p.cached_slot_table().is_some(), "the mount's index: kept");
    }

    #[test]
    fn reads_return_exact_bytes_and_prefetch_hits() {
        let config = PrefetcherConfig { prefetch: 4, cache_bytes: 1 << 20, ..Default::default() };
        let (_rt, _client, p, bodies) = setup(20, config);
        for (i, body) in bodies.iter().enumerate() {
            let got = p.read_as0(key(i as u64), 0, 1 << 20).unwrap();
            assert_eq!(&got, body);
            std::thread::sleep(Duration::from_millis(2));
        }
        let s = p.stats.snapshot();
        assert_eq!(s.misses, 1, "only batch 0 is fetched on demand: {s:?}");
        assert!(s.hits >= 15, "{s:?}");
        assert_eq!(p.read_as0(key(3), 5000, 10).unwrap(), Bytes::new(), "past the end");
        assert_eq!(p.read_as0(key(20), 0, 10), Err(ReadError::NotFound("batch 20 of epoch 0 (tfrecord)".into())));
    }

    #[test]
    fn corrupt_and_short_bodies_are_refetched_never_returned() {
        // Without checkpoints the whole body is checked; with them, the corrupt one fails at its first.
        for every in [0, 100] {
            let config = PrefetcherConfig { prefetch: 0, ..Default::default() };
            let (_rt, client, p, bodies) = setup(3, config);
            client.checkpoint_every.store(every, Ordering::Relaxed);
            client.inject([Fault::Corrupt, Fault::Short]);
            client.fail_next([Failure::Pass, Failure::Pass, Failure::Unreachable]);
            assert_eq!(p.read_as0(key(1), 0, 4096).unwrap(), bodies[1]);
            let s = p.stats.snapshot();
            assert_eq!((s.checksum_errors, s.retries), (2, 3), "{s:?}");
        }
    }

    #[test]
    fn reads_of_a_batch_still_arriving_get_its_verified_prefix_before_the_rest() {
        let config = PrefetcherConfig { prefetch: 0, timeout: Duration::from_secs(20), ..Default::default() };
        let (_rt, client, p, bodies) = setup_sized(2, 10_000, 1, config);
        client.checkpoint_every.store(1_000, Ordering::Relaxed);
        // The body stops after its first 3,000 bytes until released.
        client.held_after.lock().unwrap().insert(1, 3_000);
        assert_eq!(p.read_as0(key(1), 0, 2_500).unwrap(), bodies[1].slice(..2_500));
        assert_eq!(p.read_as0(key(1), 1_000, 2_000).unwrap(), bodies[1].slice(1_000..3_000));
        let s = p.stats.snapshot();
        assert_eq!((s.reads, s.early_reads, s.in_flight), (2, 2, 1), "{s:?}");
        // Bytes past the verified prefix wait for it (here, for the release).
        let reader = {
            let p = p.clone();
            std::thread::spawn(move || p.read_as0(key(1), 3_000, 4_000))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!reader.is_finished(), "a read past the verified prefix waits");
        client.held_after.lock().unwrap().clear();
        assert_eq!(reader.join().unwrap().unwrap(), bodies[1].slice(3_000..7_000));
        // Once whole, the batch is read from its body as before.
        eventually("the fetch ends", || p.stats.snapshot().in_flight == 0);
        assert_eq!(p.read_as0(key(1), 0, 1 << 20).unwrap(), bodies[1]);
        assert_eq!(p.stats.snapshot().checksum_errors, 0);
    }

    #[test]
    fn a_corrupt_body_releases_nothing_past_its_last_good_checkpoint() {
        let config = PrefetcherConfig { prefetch: 0, timeout: Duration::from_secs(20), ..Default::default() };
        let (_rt, client, p, bodies) = setup_sized(2, 10_000, 1, config);
        client.checkpoint_every.store(1_000, Ordering::Relaxed);
        // The first attempt's first byte is flipped: its first checkpoint fails, and the retry is held
        // after 3,000 bytes, so what a reader gets can only come from the retry's verified prefix.
        client.inject([Fault::Corrupt]);
        client.held_after.lock().unwrap().insert(1, 3_000);
        assert_eq!(p.read_as0(key(1), 0, 1_000).unwrap(), bodies[1].slice(..1_000));
        let s = p.stats.snapshot();
        assert_eq!((s.checksum_errors, s.early_reads), (1, 1), "{s:?}");
        client.held_after.lock().unwrap().clear();
        assert_eq!(p.read_as0(key(1), 0, 1 << 20).unwrap(), bodies[1]);
    }

    #[test]
    fn refusals_fail_at_once_and_outages_after_the_timeout() {
        let config = PrefetcherConfig { prefetch: 0, timeout: Duration::from_millis(600), ..Default::default() };
        let (_rt, client, p, _) = setup(3, config);
        client.fail_next([Failure::Status(401)]);
        assert!(matches!(p.read_as0(key(0), 0, 10), Err(ReadError::Refused(_))));
        client.fail_next(std::iter::repeat_n(Failure::Unreachable, 1000));
        let started = Instant::now();
        assert!(matches!(p.read_as0(key(1), 0, 10), Err(ReadError::Timeout { .. })));
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(600) && took < Duration::from_secs(3), "{took:?}");
        // The fetch gives up at the same deadline as the reader and then releases its reservation.
        let released = Instant::now() + Duration::from_secs(3);
        while p.cache_used() != 0 && Instant::now() < released {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(p.cache_used(), 0, "a failed fetch releases its reservation");
    }

    /// A reader that finds a batch's fetch failing waits out its own `timeout`, not the fetch's: here it
    /// arrives 1.2 s into a 2 s timeout, the fetch gives up at 2 s, the server is back at 2.3 s, and the
    /// reader gets the batch (it once got the first reader's error at 2 s, 0.8 s into its own wait).
    #[test]
    fn a_reader_joining_a_failing_fetch_waits_out_its_own_timeout() {
        let config = PrefetcherConfig { prefetch: 0, timeout: Duration::from_secs(2), ..Default::default() };
        let (_rt, client, p, bodies) = setup(3, config);
        client.fail_next(std::iter::repeat_n(Failure::Unreachable, 10_000));
        let first = {
            let p = p.clone();
            std::thread::spawn(move || p.read_as0(key(1), 0, 4096))
        };
        std::thread::sleep(Duration::from_millis(1200));
        let second = {
            let p = p.clone();
            std::thread::spawn(move || (p.read_as0(key(1), 0, 4096), Instant::now()))
        };
        assert!(matches!(first.join().unwrap(), Err(ReadError::Timeout { .. })), "the first reader's time is up");
        let failed_at = Instant::now();
        std::thread::sleep(Duration::from_millis(300));
        client.heal();
        let (got, at) = second.join().unwrap();
        assert_eq!(
            got.unwrap(),
            bodies[1],
            "the second reader had time left: {:?} after the first failed",
            at - failed_at
        );
    }

    /// A read waits past its `timeout` while bytes come (a busy link), but not for a fetch that keeps
    /// failing: every body wrong (bytes came for each), it fails once its fetch gives up, about its
    /// `timeout` after it began. (It waited without end: each new fetch started past the read's first
    /// `timeout` failed after the read's next deadline, which the bytes of that fetch had moved on.)
    #[test]
    fn a_read_whose_fetch_keeps_failing_while_bytes_come_fails_after_its_timeout() {
        let config = PrefetcherConfig { prefetch: 0, timeout: Duration::from_millis(600), ..Default::default() };
        let (_rt, client, p, _bodies) = setup(3, config);
        client.inject(std::iter::repeat_n(Fault::Corrupt, 100_000));
        let started = Instant::now();
        let read = {
            let p = p.clone();
            std::thread::spawn(move || p.read_as0(key(1), 0, 4096))
        };
        while !read.is_finished() && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(read.is_finished(), "the read still waits after {:?}", started.elapsed());
        assert!(matches!(read.join().unwrap(), Err(ReadError::Timeout { .. })));
        assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
        assert!(client.received.load(Ordering::Relaxed) > 0, "bytes came all along");
    }

    /// A read whose fetch failed an attempt before the read's `timeout` (a stream passed over on a busy
    /// link, asked again) waits on past it while bytes come, and gets its body: a failed attempt ends a
    /// read only once it waits past its `timeout` (the first version took one before for one after: `EIO`).
    #[test]
    fn a_read_whose_fetch_failed_an_attempt_before_its_timeout_waits_on_while_bytes_come() {
        let timeout = Duration::from_millis(600);
        let config = PrefetcherConfig { prefetch: 0, timeout, ..Default::default() };
        let (_rt, client, p, bodies) = setup(3, config);
        client.inject([Fault::Corrupt]);
        let started = Instant::now();
        let read = {
            let p = p.clone();
            std::thread::spawn(move || p.read_as0(key(1), 0, 4096))
        };
        // The first attempt failed: the next (after its backoff, 25 ms at least) hangs before its first byte.
        while p.stats.checksum_errors.load(Ordering::Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        client.held_after.lock().unwrap().insert(1, 0);
        // Other bodies' bytes on the busy link, until the body is let go at 2.5 timeouts.
        while started.elapsed() < timeout * 5 / 2 {
            client.received.fetch_add(1000, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(50));
        }
        client.held_after.lock().unwrap().clear();
        let got = read.join().unwrap().expect("a busy link is no outage");
        assert_eq!(got, bodies[1]);
    }

    /// A read that joins a prefetch whose bodies keep failing their checksums (bytes came for each) fails
    /// about its `timeout` after it began: not a `timeout` after the fetch it started when the prefetch
    /// gave up (it waited on while that fetch's bytes came: twice its `timeout` in all).
    #[test]
    fn a_read_joining_a_failing_prefetch_fails_after_its_own_timeout() {
        let timeout = Duration::from_secs(2);
        let config = PrefetcherConfig { prefetch: 0, timeout, ..Default::default() };
        let (_rt, client, p, _bodies) = setup(3, config);
        client.inject(std::iter::repeat_n(Fault::Corrupt, 100_000));
        let manifest = p.manifest(0, TF).unwrap();
        p.start_prefetches(&[Target { listing: key(1).listing, index: 1 }], &objects_of(manifest));
        assert!(p.cache.prefetching() > 0, "the prefetch runs");
        std::thread::sleep(Duration::from_millis(20));
        let started = Instant::now();
        let read = p.read_as0(key(1), 0, 4096);
        assert!(matches!(read, Err(ReadError::Timeout { .. })), "{read:?}");
        let took = started.elapsed();
        assert!(took < timeout * 3 / 2, "failed after {took:?}, its timeout {timeout:?}");
        assert!(p.stats.checksum_errors.load(Ordering::Relaxed) > 1, "bytes came, each body wrong");
    }

    /// Prefetches started from many threads at once never put more bytes in flight than the cap: the
    /// check and the count are one step under the cache lock (the count once came after the lock was
    /// dropped, and admissions racing past the check each passed it).
    #[test]
    fn prefetches_started_from_many_threads_at_once_stay_under_the_cap() {
        for _ in 0..20 {
            let cap = 20_000;
            let config = PrefetcherConfig { max_prefetch_bytes: cap, cache_bytes: 1 << 30, ..Default::default() };
            let (_rt, client, p, _) = setup(1600, config);
            p.window.throughput.lock().unwrap().delivered = 1 << 30; // past the first transfers' smaller cap
            client.held.lock().unwrap().extend(0..1600);
            let manifest = p.manifest(0, TF).unwrap();
            let start = std::sync::Barrier::new(16);
            std::thread::scope(|s| {
                for t in 0..16u64 {
                    let (p, manifest, start) = (&p, &manifest, &start);
                    s.spawn(move || {
                        let targets: Vec<Target> =
                            (t * 100..(t + 1) * 100).map(|index| Target { listing: key(0).listing, index }).collect();
                        start.wait();
                        for target in targets.chunks(1) {
                            p.start_prefetches(target, &objects_of(manifest.clone()));
                        }
                    });
                }
            });
            let in_flight = p.cache.prefetching();
            client.held.lock().unwrap().clear();
            assert!(in_flight <= cap, "{in_flight} bytes of prefetches in flight, over the cap of {cap}");
        }
    }

    #[test]
    fn prefetches_in_flight_are_capped_but_reads_are_not() {
        // Batches 1 and 2 (1037 + 1074 bytes) fit in 2600 bytes; batch 3 (1111) would not.
        let config = PrefetcherConfig { prefetch: 16, max_prefetch_bytes: 2600, ..Default::default() };
        let (_rt, client, p, bodies) = setup(30, config);
        p.window.throughput.lock().unwrap().delivered = 1 << 30; // past the first transfers' smaller cap
                                                                 // The window's fetches hang until released.
        client.held.lock().unwrap().extend(1..20);
        assert_eq!(p.read_as0(key(0), 0, 1 << 20).unwrap(), bodies[0]);
        let s = p.stats.snapshot();
        assert_eq!(s.prefetches, 2, "only 2 of the 16-batch window may start at once: {s:?}");
        // A read of another batch is served while they hang: it does not queue behind them (if it did,
        // it would wait out the 60 s timeout and fail).
        assert_eq!(p.read_as0(key(20), 0, 1 << 20).unwrap(), bodies[20]);
        assert_eq!(p.stats.snapshot().in_flight, 2, "the capped prefetches still hang");
        client.held.lock().unwrap().clear();
    }

    #[test]
    fn evicted_buffers_are_reused_within_the_budget() {
        // Batches of 300-600 KB, a cache of 4 of them: 20 sequential reads evict and refill it 5 times.
        let mb = 1 << 20;
        let config = PrefetcherConfig { prefetch: 2, cache_bytes: 2 * mb, ..Default::default() };
        let (_rt, _client, p, bodies) = setup_sized(20, 300_000, 1000, config);
        let mut buffers = std::collections::HashSet::new();
        for (i, body) in bodies.iter().enumerate() {
            let got = p.read_as0(key(i as u64), 0, 1 << 30).unwrap();
            assert_eq!(&got, body);
            buffers.insert(got.as_ptr() as usize);
            drop(got);
            assert!(p.cache_used() <= 2 * mb, "{} > budget", p.cache_used());
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(buffers.len() < 12, "20 bodies in {} distinct buffers: not reused", buffers.len());
    }

    #[test]
    fn backing_files_hold_the_verified_bytes_fetched_or_copied() {
        use std::os::unix::fs::FileExt;
        let contents = |f: &std::fs::File| {
            let mut got = vec![0; f.metadata().unwrap().len() as usize];
            f.read_exact_at(&mut got, 0).unwrap();
            got
        };
        let config = PrefetcherConfig { prefetch: 2, prefetch_bytes: 0, last_epoch: 0, ..Default::default() };
        let (_rt, client, p, bodies) = setup(6, config);
        // Fetched into a buffer, copied into a memory file at the first open.
        let f = p.backing_file(key(0), 1).unwrap();
        assert_eq!(contents(&f), bodies[0]);
        assert!(Arc::ptr_eq(&f, &p.backing_file(key(0), 1).unwrap()), "one memory file per batch");
        assert_eq!(p.read_as0(key(0), 3, 10).unwrap(), bodies[0][3..13], "daemon reads see the same bytes");
        // Fetched straight into memory files, corrupt bodies refetched.
        p.fetch_into_memfds(true);
        client.inject([Fault::Corrupt]);
        for b in 3..6 {
            let f = p.backing_file(key(b), 1).unwrap();
            assert_eq!(contents(&f), bodies[b as usize]);
            assert_eq!(p.read_as0(key(b), 0, 1 << 20).unwrap(), bodies[b as usize]);
        }
        let s = p.stats.snapshot();
        assert_eq!(s.checksum_errors, 1, "{s:?}");
        // Batch 0 copied; 3, 4 and 5 fetched into memory files (1 and 2 were prefetched into buffers).
        let in_files: usize = [0, 3, 4, 5].iter().map(|&b| bodies[b].len()).sum();
        assert_eq!(s.passthrough_bytes, in_files as u64, "{s:?}");
    }

    /// Memory files of evicted batches are filled again (one copy) once nothing holds them, and never
    /// while a loader's mapping does: that mapping keeps its batch's bytes however many batches come
    /// after. Every batch is its body. (Root only: elsewhere memory files are memfds, sealed for good.)
    #[test]
    fn evicted_memory_files_are_filled_again_but_never_one_still_mapped() {
        use std::os::unix::fs::FileExt;
        if crate::sys::use_huge_pages().is_err() {
            return;
        }
        let mb = 1u64 << 20;
        let config = PrefetcherConfig { prefetch: 2, cache_bytes: 24 * mb, ..Default::default() };
        let (_rt, _client, p, bodies) = setup_sized(30, 3 << 20, 4001, config);
        p.fetch_into_memfds(true);
        // Batch 8 is the largest: the best fit of every later body, were it ever idle.
        let mut loaders_map = None;
        for (i, body) in bodies.iter().enumerate() {
            let f = p.backing_file(key(i as u64), 1).unwrap();
            let mut got = vec![0; f.metadata().unwrap().len() as usize];
            f.read_exact_at(&mut got, 0).unwrap();
            assert!(got == body[..], "batch {i}'s memory file holds another body");
            if i == 8 {
                let other = crate::sys::reopen(&f, false).unwrap();
                loaders_map = Some(batchfs::mmap::MappedFile::open_file(&other).unwrap());
            }
            drop(f);
            assert!(p.cache_used() <= 24 * mb, "over the budget");
        }
        assert!(loaders_map.unwrap().bytes() == &bodies[8][..], "a mapped file was filled again");
        let s = p.stats.snapshot();
        assert!(s.recycled_bytes > 0 && s.recycled_bytes < s.passthrough_bytes, "{s:?}");
    }

    /// Writing a large body into its memory file (the first passthrough open of a batch fetched into a
    /// buffer) does not hold up the cache: choosing a batch to evict looks at every entry's memory file,
    /// and once waited for this write, with the cache lock held, so every admission queued behind it.
    #[test]
    fn making_a_memory_file_does_not_hold_up_the_cache() {
        let config = PrefetcherConfig { prefetch: 0, cache_bytes: 1 << 30, ..Default::default() };
        let (_rt, _client, p, _) = setup_sized(1, 128 << 20, 1, config);
        p.read_as0(key(0), 0, 10).unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                p.backing_file(key(0), 1).unwrap();
                done.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(Duration::from_millis(3));
            let _ = p.cache.victim(true);
            assert!(!done.load(Ordering::SeqCst), "choosing a victim waited for the 128 MB write");
        });
    }

    /// Waits until `done` holds (at most 10 s).
    fn eventually(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_large_source_file_is_fetched_in_verified_ranges_prefetched_ahead_of_its_reader() {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|_, _| vec![]);
        let big: Bytes = (0..10_000u32).map(|i| (i * 13 % 251) as u8).collect::<Vec<u8>>().into();
        client.files = vec![("big.tfrecord".into(), big.clone()), ("small.idx".into(), Bytes::from_static(b"0 9\n"))];
        client.chunk_bytes = 1000;
        let client = Arc::new(client);
        let config = PrefetcherConfig { prefetch: 3, cache_bytes: 5000, ..Default::default() };
        let p = Prefetcher::new(client.clone(), runtime.handle().clone(), config);
        let (dir, list) = p.list_dir("").unwrap();
        assert_eq!(list.files.len(), 2, "two pages of one file each, merged");
        assert_eq!(p.file_chunks(dir, 0).unwrap(), 0..10);
        assert_eq!(p.file_chunks(dir, 1).unwrap(), 10..11);
        // A flipped byte in the first chunk is caught by that chunk's CRC and refetched.
        client.inject([Fault::Corrupt]);
        let mut read = Vec::new();
        for offset in (0..10_000).step_by(700) {
            read.extend_from_slice(&p.read_file(dir, 0, offset, 700, 0).unwrap());
        }
        assert_eq!(read, big, "the whole file, in reads that straddle chunks");
        assert_eq!(p.read_file(dir, 1, 0, 100, 0).unwrap(), Bytes::from_static(b"0 9\n"));
        let s = p.stats.snapshot();
        assert_eq!(s.checksum_errors, 1, "{s:?}");
        assert!(s.prefetches >= 7, "the chunks ahead of the reader were prefetched: {s:?}");
        assert!(s.cache_bytes <= 5000, "a 10 KB file through a 5 KB cache: {s:?}");
        let ranges = client.ranges.lock().unwrap().clone();
        assert!(
            ranges.iter().all(|(path, offset, len)| { path == "small.idx" || (*len == 1000 && offset % 1000 == 0) }),
            "{ranges:?}"
        );
    }

    /// With a node cache, a large file kept there whole (as warming keeps it) is read chunk by chunk from
    /// it, each chunk checked against its own CRC: nothing from the server; chunks fetched are kept too.
    #[test]
    fn chunks_of_a_file_the_node_cache_holds_whole_are_read_from_it() {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let mut client = MemoryClient::new(|_, _| vec![]);
        let big: Bytes = (0..10_000u32).map(|i| (i * 7 % 253) as u8).collect::<Vec<u8>>().into();
        let other: Bytes = (0..3_000u32).map(|i| (i % 13) as u8).collect::<Vec<u8>>().into();
        client.files = vec![("big.jpg".into(), big.clone()), ("other.jpg".into(), other.clone())];
        client.chunk_bytes = 1000;
        let client = Arc::new(client);
        let disk = tempfile::tempdir().unwrap();
        let nc = NodeCache::open(disk.path(), 1 << 30, "d").unwrap();
        // The first file, sample 0 of the file tree.
        let big_key = crate::node_cache::Key::sample(Sent { bytes: big.len() as u64, crc32c: crc32c::crc32c(&big) }, 0);
        nc.put(big_key, &big).unwrap();
        let config = PrefetcherConfig { prefetch: 3, cache_bytes: 5000, ..Default::default() };
        let p = Prefetcher::new(client.clone(), runtime.handle().clone(), config);
        p.use_node_cache(nc.clone());
        let (dir, _) = p.list_dir("").unwrap();
        let mut read = Vec::new();
        for offset in (0..10_000).step_by(700) {
            read.extend_from_slice(&p.read_file(dir, 0, offset, 700, 0).unwrap());
        }
        assert_eq!(read, big);
        let of = |name: &str| client.ranges.lock().unwrap().iter().filter(|r| r.0 == name).count();
        assert_eq!(of("big.jpg"), 0, "{:?}", client.ranges.lock().unwrap());
        // A file the node cache lacks is fetched (the window ran into it already), each chunk once, and
        // its chunks kept: a new mount's read of it fetches nothing.
        assert_eq!(p.read_file(dir, 1, 0, 5000, 0).unwrap(), other);
        let fetched = of("other.jpg");
        assert_eq!(fetched, 3, "three chunks, once each");
        // Big, then the three chunks.
        eventually("the chunks on the disk", || nc.stats.writes.load(Ordering::Relaxed) == 4);
        let fresh = Prefetcher::new(client.clone(), runtime.handle().clone(), PrefetcherConfig::default());
        fresh.use_node_cache(nc);
        let (dir, _) = fresh.list_dir("").unwrap();
        assert_eq!(fresh.read_file(dir, 1, 0, 5000, 0).unwrap(), other);
        assert_eq!(of("other.jpg"), fetched, "a new mount finds them");
    }

    #[test]
    fn the_first_dali_index_read_under_raw_fetches_them_all() {
        // With `prefetch=0`, nothing but what is read (the rule of every window, raw/'s indexes included).
        for (prefetch, indexes) in [(2, 6), (0, 1)] {
            let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            let mut client = MemoryClient::new(|_, _| vec![]);
            for shard in 0..6 {
                client.files.push((format!("s{shard}.tfrecord"), Bytes::from(vec![shard as u8; 3000])));
                client.files.push((format!("s{shard}.tfrecord.idx"), Bytes::from(format!("0 {shard}\n"))));
            }
            client.files.sort();
            client.chunk_bytes = 1000;
            let client = Arc::new(client);
            let config = PrefetcherConfig { prefetch, ..Default::default() };
            let p = Prefetcher::new(client.clone(), runtime.handle().clone(), config);
            let (dir, list) = p.list_dir("").unwrap();
            let twin = list.files.iter().position(|f| f.path == "s3.tfrecord.idx").unwrap() as u64;
            assert_eq!(p.read_file(dir, twin, 0, 100, 0).unwrap(), Bytes::from("0 3\n"));
            let fetched = || {
                let ranges = client.ranges.lock().unwrap();
                ranges.iter().filter(|(path, _, _)| path.ends_with(".idx")).count()
            };
            eventually("every index", || fetched() == indexes);
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(fetched(), indexes, "prefetch={prefetch}");
        }
    }

    #[test]
    fn index_twins_are_all_fetched_at_the_first_one() {
        let (_rt, client, p, bodies) = setup(40, PrefetcherConfig { prefetch: 4, ..Default::default() });
        let idx = |b| ObjectKey::batch(0, b, BatchFormat::TfrecordIdx);
        assert_eq!(p.read_as0(idx(0), 0, 1 << 20).unwrap(), bodies[0]);
        eventually("every twin", || client.fetches.load(Ordering::Relaxed) == 40);
        for (b, body) in bodies.iter().enumerate() {
            assert_eq!(&p.read_as0(idx(b as u64), 0, 1 << 20).unwrap(), body);
        }
        assert_eq!(p.stats.snapshot().misses, 1, "only the first twin waited on its own request");
    }

    #[test]
    fn a_thread_pool_reading_in_file_order_gets_the_window_from_the_first_read() {
        // Eight threads (eight owners) take the next batch number in turn, as a loader's thread pool
        // does; each fetch takes 5 ms.
        let (_rt, client, p, bodies) = setup(64, PrefetcherConfig { prefetch: 8, ..Default::default() });
        *client.delay.lock().unwrap() = Duration::from_millis(5);
        let next = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..8u32 {
                let (p, next, bodies) = (&p, &next, &bodies);
                s.spawn(move || loop {
                    let b = next.fetch_add(1, Ordering::Relaxed);
                    if b >= 64 {
                        break;
                    }
                    assert_eq!(&p.read(key(b), 0, 1 << 20, 100 + t).unwrap(), &bodies[b as usize]);
                });
            }
        });
        // The pool's first reads start together, before any window exists; after them every read is a
        // hit (tracked per thread, each thread's reads look like a ragged stride: mostly misses).
        let s = p.stats.snapshot();
        assert!(s.misses <= 8 + 1, "the window runs ahead of the pool from its first read: {s:?}");
    }

    #[test]
    fn reading_to_the_end_of_an_epoch_warms_the_next_one_but_not_past_the_last() {
        let config = PrefetcherConfig { prefetch: 4, last_epoch: 1, ..Default::default() };
        let (_rt, _client, p, bodies) = setup(20, config);
        let at = |epoch, b| ObjectKey::batch(epoch, b, TF);
        for epoch in 0..2 {
            for (b, body) in bodies.iter().enumerate() {
                assert_eq!(&p.read_as0(at(epoch, b as u64), 0, 1 << 20).unwrap(), body);
            }
            if epoch == 0 {
                // The next epoch's start is warmed by a background task (its manifest first): wait for
                // it, or a busy machine lets the reader get there first.
                eventually("epoch 1's first batch", || p.cache.contains(&at(1, 0)));
            }
            eventually("the window's fetches", || p.stats.snapshot().in_flight == 0);
        }
        // Epoch 1 began warm: the only miss is epoch 0's first read.
        assert_eq!(p.stats.snapshot().misses, 1, "{:?}", p.stats.snapshot());
        assert!(p.cache.keys().iter().all(|k| k.listing != L2), "no prefetch past the last epoch");
    }

    #[test]
    fn a_new_mount_asks_for_an_eighth_of_its_window_then_more_as_bytes_arrive() {
        // 8 MB batches under the default 256 MB cap: before anything arrived, 32 MB (4 batches) may be in
        // flight; once 64 MB have arrived, 128 MB (16 batches).
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let bodies: Vec<Bytes> = (0..20u8).map(|i| Bytes::from(vec![i; 8 << 20])).collect();
        let b2 = bodies.clone();
        let client = Arc::new(MemoryClient::new(move |_, _| b2.clone()));
        let p = Prefetcher::new(client.clone(), runtime.handle().clone(), PrefetcherConfig::default());
        client.held.lock().unwrap().extend(1..20);
        assert_eq!(p.read_as0(key(0), 0, 1 << 20).unwrap(), bodies[0][..1 << 20]);
        let s = p.stats.snapshot();
        // 8 MB delivered (batch 0): twice that is 16 MB, under an eighth (32 MB): 4 batches.
        assert_eq!(s.in_flight, 4, "{s:?}");
        p.window.throughput.lock().unwrap().delivered = 64 << 20;
        // The next read (a hit) lets the window grow to what the cap now allows.
        assert_eq!(p.read_as0(key(0), 1 << 20, 100).unwrap(), bodies[0][1 << 20..(1 << 20) + 100]);
        eventually("the window grows", || p.stats.snapshot().in_flight == 16);
        client.held.lock().unwrap().clear();
    }

    #[test]
    fn large_batches_keep_a_deep_window() {
        // Sixteen 8 MB batches ahead (128 MB) are in flight at once under the default byte cap: a
        // 64 MB cap once let only a few large batches run.
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let bodies: Vec<Bytes> = (0..20u8).map(|i| Bytes::from(vec![i; (8 << 20) + usize::from(i)])).collect();
        let b2 = bodies.clone();
        let client = Arc::new(MemoryClient::new(move |_, _| b2.clone()));
        let p = Prefetcher::new(client.clone(), runtime.handle().clone(), PrefetcherConfig::default());
        p.window.throughput.lock().unwrap().delivered = 1 << 30; // past the first transfers' smaller cap
        client.held.lock().unwrap().extend(1..20);
        assert_eq!(p.read_as0(key(0), 0, 1 << 20).unwrap(), bodies[0][..1 << 20]);
        assert_eq!(p.stats.snapshot().in_flight, 16, "{:?}", p.stats.snapshot());
        client.held.lock().unwrap().clear();
        for (b, body) in bodies.iter().enumerate().skip(1) {
            assert_eq!(p.read_as0(key(b as u64), 8 << 20, 100).unwrap(), body[8 << 20..]);
        }
    }

    #[test]
    fn small_batches_get_a_window_as_deep_in_bytes_as_prefetch_bytes() {
        // Batches of 1000-1300 bytes: 4 batches are ~4.5 KB; 20 KB take about 18 of them. The window stops
        // at 16 x 4 = 64 batches however small they are, and raw/ files keep 4.
        for (prefetch_bytes, window) in [(0, 4), (20_000, 18), (10 << 20, 64)] {
            let config = PrefetcherConfig { prefetch: 4, prefetch_bytes, last_epoch: 0, ..Default::default() };
            let (_rt, client, p, _) = setup(100, config);
            client.held.lock().unwrap().extend(1..100);
            p.read_as0(key(0), 0, 10).unwrap();
            let m = objects_of(p.manifest(0, TF).unwrap());
            let mean = m.bytes() / 100;
            let expected = if prefetch_bytes == 20_000 { prefetch_bytes.div_ceil(mean) as usize } else { window };
            assert_eq!(p.window.width(key(0).listing.kind.follow(key(0).listing), &m), expected);
            assert_eq!(p.stats.snapshot().prefetches, expected as u64, "{prefetch_bytes}");
            assert_eq!(p.window.width(CHUNKS.follow(chunks::key(0, 0).listing), &m), 4);
            client.held.lock().unwrap().clear();
        }
    }

    #[test]
    fn batches_left_unread_by_a_reader_that_stopped_make_room_once_stale() {
        // Room for about six batches; a reader reads a little of epoch 0 and stops, leaving its window
        // (four batches nobody will read) in the cache.
        let stale_after = Duration::from_millis(50);
        let config = PrefetcherConfig {
            prefetch: 4,
            prefetch_bytes: 0,
            cache_bytes: 7000,
            last_epoch: 0,
            stale_after,
            ..Default::default()
        };
        let (_rt, _client, p, bodies) = setup(10, config);
        assert_eq!(p.read_as0(key(0), 0, 10).unwrap(), bodies[0][..10]);
        eventually("the first window", || p.stats.snapshot().prefetches == 4 && p.stats.snapshot().in_flight == 0);
        std::thread::sleep(stale_after * 2);
        // Another reader starts on another epoch: its whole window starts, in place of the stale one.
        let other = |b| ObjectKey::batch(5, b, TF);
        assert_eq!(p.read_as0(other(0), 0, 1 << 20).unwrap(), bodies[0]);
        eventually("the second window", || p.stats.snapshot().in_flight == 0);
        assert_eq!(p.stats.snapshot().prefetches, 8, "{:?}", p.stats.snapshot());
        for b in 1..=4 {
            assert_eq!(p.read_as0(other(b), 0, 1 << 20).unwrap(), bodies[b as usize]);
        }
        assert_eq!(p.stats.snapshot().misses, 2, "{:?}", p.stats.snapshot());
        assert!(p.cache_used() <= 7000);
    }

    #[test]
    fn cache_too_small_is_an_error() {
        let config = PrefetcherConfig { cache_bytes: 100, ..Default::default() };
        let (_rt, _, p, _) = setup(2, config);
        assert!(matches!(p.read_as0(key(0), 0, 10), Err(ReadError::CacheTooSmall { .. })));
    }

    /// Performs `reads` (batch, offset, size): each returns the model's bytes, and afterwards the cache
    /// (idle buffers included) is within `budget`.
    fn reads_match_the_model(
        p: &Arc<Prefetcher>,
        bodies: &[Bytes],
        reads: &[(u64, u64, u32)],
        budget: u64,
    ) -> Result<(), TestCaseError> {
        for &(batch, offset, size) in reads {
            let body = &bodies[batch as usize];
            let got = p.read_as0(key(batch), offset, size).unwrap();
            let start = (offset as usize).min(body.len());
            let end = (offset as usize + size as usize).min(body.len());
            prop_assert_eq!(&got[..], &body[start..end]);
            drop(got);
            prop_assert!(p.cache_used() <= budget);
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        /// Reference model: any sequence of reads returns exactly the bytes of the model (the bodies),
        /// and the cache never holds more than its budget.
        #[test]
        fn random_reads_match_the_model(
            reads in proptest::collection::vec((0u64..30, 0u64..1400, 1u32..2000), 1..60),
            prefetch in 0usize..6,
            budget_batches in 2u64..10,
            memfds: bool,
            checkpoint_every in proptest::option::of(1usize..1500),
        ) {
            let config = PrefetcherConfig { prefetch, cache_bytes: budget_batches * 1300, ..Default::default() };
            let (_rt, client, p, bodies) = setup(30, config.clone());
            client.checkpoint_every.store(checkpoint_every.unwrap_or(0), Ordering::Relaxed);
            p.fetch_into_memfds(memfds);
            reads_match_the_model(&p, &bodies, &reads, config.cache_bytes)?;
        }

        /// The same with bodies large enough (300-600 KB) for their buffers to be pooled and reused.
        #[test]
        fn random_reads_of_pooled_bodies_match_the_model(
            reads in proptest::collection::vec((0u64..12, 0u64..700_000, 1u32..(1 << 20)), 1..30),
            prefetch in 0usize..4,
            budget_batches in 2u64..6,
            checkpoint_every in proptest::option::of(1000usize..200_000),
        ) {
            let config = PrefetcherConfig { prefetch, cache_bytes: budget_batches * 600_000, ..Default::default() };
            let (_rt, client, p, bodies) = setup_sized(12, 300_000, 1000, config.clone());
            client.checkpoint_every.store(checkpoint_every.unwrap_or(0), Ordering::Relaxed);
            reads_match_the_model(&p, &bodies, &reads, config.cache_bytes)?;
        }
    }
}
