//! Live counters of a mount, served as JSON at `.batchfs/stats` and printed by `batchfs stats`.
//!
//! The counters are the mount's own. What other parts know (each server's health, the node cache, the
//! supervisor's ledger) they feed into each snapshot ([`Stats::feed`]): this module holds none of them.

use crate::client::health::ServerSnapshot;
use crate::sync::{AtomicU64, Ordering};
use serde::{Deserialize, Serialize};
use std::sync::Mutex;

/// Counters, updated lock-free.
#[derive(Debug, Default)]
pub struct Stats {
    pub bytes_served: AtomicU64,
    pub reads: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub stalls: AtomicU64,
    pub stall_ns: AtomicU64,
    pub in_flight: AtomicU64,
    pub cache_bytes: AtomicU64,
    pub prefetches: AtomicU64,
    pub fetched_bytes: AtomicU64,
    pub retries: AtomicU64,
    pub checksum_errors: AtomicU64,
    pub errors: AtomicU64,
    pub evictions: AtomicU64,
    pub passthrough_opens: AtomicU64,
    pub passthrough_bytes: AtomicU64,
    pub recycled_bytes: AtomicU64,
    pub daemon_opens: AtomicU64,
    pub page_cache_drops: AtomicU64,
    pub early_reads: AtomicU64,
    pub lookups: AtomicU64,
    pub ring_opens: AtomicU64,
    /// Groups each class's window of `shuffled/` spans now (0: no `shuffled/`).
    pub shuffled_window: AtomicU64,
    /// 1 when the kernel accepted FUSE passthrough at mount time.
    pub passthrough: AtomicU64,
    /// Warming (`warm=raw`): files and bytes in the node cache so far, of all there are.
    pub warm_files: AtomicU64,
    pub warm_files_total: AtomicU64,
    pub warm_bytes: AtomicU64,
    pub warm_bytes_total: AtomicU64,
    /// Seconds since the epoch when warming started (0: not started).
    pub warm_started: AtomicU64,
    /// Bytes of prefetches in flight (the prefetcher's own count, shared).
    pub prefetching: crate::sync::Arc<AtomicU64>,
    /// The cap on them when last checked, and the measured delivery rate (bytes per second).
    pub prefetch_cap: AtomicU64,
    pub delivery_rate: AtomicU64,
    /// What the other parts add to each snapshot.
    feeds: Feeds,
}

/// A part's contribution to a snapshot: it fills in its own fields.
type Feed = Box<dyn Fn(&mut StatsSnapshot) + Send + Sync>;

#[derive(Default)]
struct Feeds(Mutex<Vec<Feed>>);

impl std::fmt::Debug for Feeds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} feeds", self.0.lock().map_or(0, |feeds| feeds.len()))
    }
}

/// A point-in-time copy of [`Stats`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// Bytes returned to readers: by the daemon's reads, plus, with passthrough, each file the kernel
    /// serves (counted whole, once per time it was fetched, at its first open).
    pub bytes_served: u64,
    /// Read requests answered with data by the daemon (passthrough reads never reach it).
    pub reads: u64,
    /// Reads and passthrough opens whose file was already cached or in flight (prefetched, or fetched
    /// for another reader).
    pub hits: u64,
    /// Reads and passthrough opens that had to start the fetch of their file (on demand).
    pub misses: u64,
    /// Reads and passthrough opens that had to wait for a fetch.
    pub stalls: u64,
    /// Total time readers waited, in microseconds.
    pub stall_us: u64,
    /// Fetches in flight now.
    pub in_flight: u64,
    /// Bytes held or reserved by the cache now.
    pub cache_bytes: u64,
    /// Fetches started ahead of a reader.
    pub prefetches: u64,
    /// Bytes received from servers.
    pub fetched_bytes: u64,
    /// Fetch attempts retried after a failure.
    pub retries: u64,
    /// Bodies refetched because their size or CRC32C did not match the manifest.
    pub checksum_errors: u64,
    /// Requests answered EIO: reads and opens whose bytes could not be had (after `timeout`, or refused).
    pub errors: u64,
    /// Batches dropped from the cache to make room.
    pub evictions: u64,
    /// Whether verified batches are handed to the kernel (FUSE passthrough) so reads and mmap faults do
    /// not reach the daemon; false when the kernel or privileges refuse, or `passthrough=false`.
    #[serde(default)]
    pub passthrough: bool,
    /// Opens served by passthrough: their reads never reach the daemon and are not in `reads` or
    /// `bytes_served`.
    #[serde(default)]
    pub passthrough_opens: u64,
    /// Bytes put into memory files for passthrough (fetched into them, or copied at the first open).
    #[serde(default)]
    pub passthrough_bytes: u64,
    /// Of those, bytes received straight into the pages of a memory file filled again (one copy): an
    /// evicted batch's, once no loader had it open or mapped (see `huge_pages`).
    #[serde(default)]
    pub recycled_bytes: u64,
    /// Whether the memory files are made on the mount's private huge-page tmpfs (`huge_pages`), not as
    /// memfds of 4 KiB pages.
    #[serde(default)]
    pub huge_pages: bool,
    /// Opens whose reads go through the daemon (passthrough off, refused, or the file already open so).
    #[serde(default)]
    pub daemon_opens: u64,
    /// Files read through the daemon whose kernel page cache was dropped at their last close
    /// (`page_cache=drop`).
    #[serde(default)]
    pub page_cache_drops: u64,
    /// Names the daemon looked up (a listing that carried a name's entry spares its lookup).
    #[serde(default)]
    pub lookups: u64,
    /// Opens the kernel sent over a FUSE ring (`fuse_uring`) rather than `/dev/fuse`.
    #[serde(default)]
    pub ring_opens: u64,
    /// Requests the FUSE rings' watchdog sent from a CPU where a ring thread had been busy for 100 ms
    /// while another was idle, so that a request the kernel queued behind the busy ones is taken
    /// (`fuse_uring`).
    #[serde(default)]
    pub ring_kicks: u64,
    /// Daemon reads answered from a batch still arriving: their bytes were verified by the body's
    /// checkpoints before the rest of it came.
    #[serde(default)]
    pub early_reads: u64,
    /// Groups each class's window of `shuffled/` spans now: two at first, doubled (up to eight, within
    /// `prefetch_bytes`) each time a read past a class's first window waited for its group; 0 without
    /// `shuffled/`.
    #[serde(default)]
    pub shuffled_window: u64,
    /// Bytes of prefetches in flight now, the cap on them (`max_prefetch_bytes`, or what the measured
    /// delivery rate brings in half of `stall_timeout`), and that rate in bytes per second of time with
    /// a fetch in flight (0 until a second of it is measured).
    #[serde(default)]
    pub prefetch_bytes_in_flight: u64,
    #[serde(default)]
    pub prefetch_cap: u64,
    #[serde(default)]
    pub delivery_rate: u64,
    /// Each server's counters and whether it is in rotation.
    #[serde(default)]
    pub servers: Vec<ServerSnapshot>,
    /// The node cache (`cache_dir`), if the mount has one (absent, not `null`, where it has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_cache: Option<NodeCacheSnapshot>,
    /// Warming into the node cache (`warm=raw`), if asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<WarmSnapshot>,
    /// The process serving the mount now (the worker, under a supervisor).
    #[serde(default)]
    pub worker_pid: u32,
    /// The supervisor holding the mount (0: none; the mount ends with its one process).
    #[serde(default)]
    pub supervisor_pid: u32,
    /// Workers started after the first (each a takeover: a worker died, or was upgraded).
    #[serde(default)]
    pub worker_restarts: u64,
    /// How long the last takeover left the mount without service (µs; 0 before the first). The other
    /// counters count from the current worker's start.
    #[serde(default)]
    pub last_takeover_us: u64,
}

/// What the node cache did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeCacheSnapshot {
    /// Its directory.
    pub dir: String,
    /// Bytes in it (this mount's count).
    pub bytes: u64,
    /// Objects read from it instead of the network, and their bytes.
    pub hits: u64,
    pub hit_bytes: u64,
    /// Bytes written to it.
    pub written_bytes: u64,
    /// Files found corrupt, removed and fetched anew.
    pub corrupt: u64,
    /// Files removed to stay under `cache_dir_size`.
    pub evictions: u64,
    /// Opens that found the file as this mount had written or checked it (not read again).
    #[serde(default)]
    pub unread: u64,
}

/// How far warming has got.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmSnapshot {
    pub files: u64,
    pub files_total: u64,
    pub bytes: u64,
    pub bytes_total: u64,
    /// Seconds since it started.
    pub seconds: u64,
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Stats {
    /// Has `feed` fill in its part of every snapshot from now on (the servers' health, the node cache, the
    /// ledger's counters).
    pub fn feed(&self, feed: impl Fn(&mut StatsSnapshot) + Send + Sync + 'static) {
        self.feeds.0.lock().expect("stats feeds").push(Box::new(feed));
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Copies the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut snapshot = StatsSnapshot {
            bytes_served: g(&self.bytes_served),
            reads: g(&self.reads),
            hits: g(&self.hits),
            misses: g(&self.misses),
            stalls: g(&self.stalls),
            stall_us: g(&self.stall_ns) / 1000,
            in_flight: g(&self.in_flight),
            cache_bytes: g(&self.cache_bytes),
            prefetches: g(&self.prefetches),
            fetched_bytes: g(&self.fetched_bytes),
            retries: g(&self.retries),
            checksum_errors: g(&self.checksum_errors),
            errors: g(&self.errors),
            evictions: g(&self.evictions),
            passthrough: g(&self.passthrough) != 0,
            passthrough_opens: g(&self.passthrough_opens),
            passthrough_bytes: g(&self.passthrough_bytes),
            recycled_bytes: g(&self.recycled_bytes),
            huge_pages: crate::sys::huge_pages(),
            prefetch_bytes_in_flight: g(&self.prefetching),
            prefetch_cap: g(&self.prefetch_cap),
            delivery_rate: g(&self.delivery_rate),
            daemon_opens: g(&self.daemon_opens),
            page_cache_drops: g(&self.page_cache_drops),
            lookups: g(&self.lookups),
            ring_opens: g(&self.ring_opens),
            ring_kicks: fuser::ring_kicks(),
            early_reads: g(&self.early_reads),
            shuffled_window: g(&self.shuffled_window),
            warm: (g(&self.warm_started) > 0).then(|| WarmSnapshot {
                files: g(&self.warm_files),
                files_total: g(&self.warm_files_total),
                bytes: g(&self.warm_bytes),
                bytes_total: g(&self.warm_bytes_total),
                seconds: crate::stats::unix_now().saturating_sub(g(&self.warm_started)),
            }),
            worker_pid: std::process::id(),
            ..StatsSnapshot::default()
        };
        for feed in self.feeds.0.lock().expect("stats feeds").iter() {
            feed(&mut snapshot);
        }
        snapshot
    }
}
