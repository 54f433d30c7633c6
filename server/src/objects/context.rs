//! What every object dataset of one server shares: the runtime its requests run on, the bound on GETs
//! in flight to each bucket, the block cache and the disk tier. One [`ObjectContext`] is made per server
//! (`cli.rs`) and handed to each dataset it opens; nothing of it is process-global, so tests build as
//! many as they like.

use super::cache::BlockCache;
use super::tier::{Tier, TierError};
use super::ObjectLimits;
use crate::config::ServerLimits;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Semaphore;

/// Bytes of memory some reads may take at once, waited for: `staging_bytes` and `get_bytes`.
pub struct Room {
    units: Semaphore,
    total: u64,
}

impl Room {
    /// The unit room is counted in.
    const UNIT: u64 = 64 << 10;

    fn new(bytes: u64) -> Room {
        let total = (bytes / Self::UNIT).clamp(1, Semaphore::MAX_PERMITS as u64);
        Room { units: Semaphore::new(total as usize), total }
    }

    /// Waits for room for `bytes`, given back when the permit drops; more than all the room takes all of
    /// it (and does not wait for ever).
    pub async fn take(&self, bytes: u64) -> tokio::sync::SemaphorePermit<'_> {
        let units = bytes.div_ceil(Self::UNIT).clamp(1, self.total).min(u32::MAX as u64) as u32;
        self.units.acquire_many(units).await.expect("a room's semaphore is never closed")
    }
}

/// Bytes of a copy's body gathered before they are written past the page cache (one aligned write), and
/// before the writeback of those written through it is started.
pub const COPY_BUFFER_BYTES: u64 = 1 << 20;

/// Idle buffers of [`COPY_BUFFER_BYTES`] kept for the next copies (one per part copied at once is in use).
const COPY_BUFFERS_IDLE: usize = 32;

/// The shared state of a server's object datasets.
pub struct ObjectContext {
    pub limits: ObjectLimits,
    /// Every object request runs here: bodies and warming wait for it from the blocking pool, indexing
    /// from the thread that opens the datasets, so it must be neither's runtime. Shut down in the
    /// background on drop (a runtime may not be dropped inside another).
    runtime: Option<tokio::runtime::Runtime>,
    /// GETs in flight to each bucket (an endpoint's): every dataset of one bucket shares its bound.
    buckets: Mutex<HashMap<String, Arc<Semaphore>>>,
    pub cache: BlockCache,
    /// Room for the parts of copies into the tier being copied at once (`staging_bytes`).
    pub staging: Room,
    /// Room for the bodies of GETs in flight (`get_bytes`).
    pub gets: Room,
    /// Aligned buffers a copy written past the page cache gathers its body in (`COPY_BUFFER_BYTES` each).
    pub copy_buffers: Arc<crate::aligned::Pool>,
    /// Whole objects kept on the server's disks (`disk_cache`), if any.
    pub tier: Option<Arc<Tier>>,
    /// The rechecks of the tier's copies that clients asked for, bounded server-wide and per copy.
    pub rechecks: super::recheck::Rechecks,
    /// Numbers the datasets, whose units share the block cache.
    next_id: AtomicU64,
}

impl ObjectContext {
    /// The context of a server with `limits`; its tier is opened (and cleaned up) now where
    /// `disk_cache` names one.
    pub fn new(limits: &ServerLimits) -> Result<Arc<ObjectContext>, TierError> {
        let tier = match &limits.disk_cache.0 {
            Some(dir) => Some(Arc::new(Tier::open(dir, limits.disk_cache_size)?)),
            None => None,
        };
        Ok(Self::with(ObjectLimits::of(limits, crate::policy::memory_limit()), tier))
    }

    /// A context of `limits` with `tier`.
    pub fn with(limits: ObjectLimits, tier: Option<Arc<Tier>>) -> Arc<ObjectContext> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("batchfs-objects")
            .enable_all()
            .build()
            .expect("cannot start the object store runtime");
        Arc::new(ObjectContext {
            cache: BlockCache::new(limits.cache),
            staging: Room::new(limits.staging_bytes),
            gets: Room::new(limits.get_bytes),
            copy_buffers: crate::aligned::Pool::new(COPY_BUFFER_BYTES as usize, COPY_BUFFERS_IDLE),
            rechecks: super::recheck::Rechecks::new(limits.rechecks),
            limits,
            runtime: Some(runtime),
            buckets: Mutex::default(),
            tier,
            next_id: AtomicU64::new(0),
        })
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        self.runtime.as_ref().expect("the runtime lives as long as the context")
    }

    /// Runs `work` on the object runtime and waits for it (from any thread, runtime or not).
    pub fn wait<T: Send + 'static>(&self, work: impl Future<Output = T> + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        self.runtime().spawn(async move {
            let _ = tx.send(work.await);
        });
        rx.recv().expect("the object store runtime stopped")
    }

    /// Runs `work`, which may borrow from the caller, on the object runtime, in a thread of its own (the
    /// caller may be in another runtime, where `block_on` is refused), and waits for it. For the reads at
    /// start (indexing, holding); bodies use [`ObjectContext::wait`], which starts no thread.
    pub fn block_here<T: Send>(&self, work: impl Future<Output = T> + Send) -> T {
        std::thread::scope(|s| s.spawn(|| self.runtime().block_on(work)).join())
            .expect("a read of the object store panicked")
    }

    /// Runs `work` on the object runtime from this thread, which must not be a runtime's, and waits for
    /// it (a thread of the caller's own for long work: indexing's reads, the stager).
    pub fn block_on<T>(&self, work: impl Future<Output = T>) -> T {
        self.runtime().block_on(work)
    }

    /// Starts `work` on the object runtime and returns at once.
    pub fn spawn(&self, work: impl Future<Output = ()> + Send + 'static) {
        self.runtime().spawn(work);
    }

    /// The bound on GETs in flight to `bucket` (named with its endpoint).
    pub fn bucket_requests(&self, bucket: &str) -> Arc<Semaphore> {
        let mut buckets = self.buckets.lock().expect("buckets");
        buckets.entry(bucket.to_owned()).or_insert_with(|| Arc::new(Semaphore::new(self.limits.requests))).clone()
    }

    /// A number of its own for a new dataset.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

impl Drop for ObjectContext {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_bounds_the_block_cache_and_the_parts_staged_at_once() {
        let limits = ServerLimits::default();
        // A server in 256 MiB: an eighth of it for the cache (not the default 1 GiB), for GETs in flight
        // and for staging.
        let small = ObjectLimits::of(&limits, 256 << 20);
        assert_eq!((small.cache, small.staging_bytes, small.get_bytes), (32 << 20, 32 << 20, 32 << 20));
        // A large machine: the defaults, staging and GETs within 512 MiB; a tiny one: two parts still fit.
        let large = ObjectLimits::of(&limits, 64 << 30);
        assert_eq!((large.cache, large.staging_bytes, large.get_bytes), (limits.object_cache, 512 << 20, 512 << 20));
        assert_eq!(ObjectLimits::of(&limits, 16 << 20).staging_bytes, 2 * limits.object_part);

        // Parts wait for room: with room for two, a third waits until one is written.
        let ctx = ObjectContext::with(ObjectLimits { staging_bytes: 2 * small.part, ..small.clone() }, None);
        ctx.block_on(async {
            let first = ctx.staging.take(small.part).await;
            let _second = ctx.staging.take(small.part).await;
            let third = tokio::time::timeout(std::time::Duration::from_millis(50), ctx.staging.take(small.part));
            assert!(third.await.is_err(), "a third part found room");
            drop(first);
            let third = tokio::time::timeout(std::time::Duration::from_secs(5), ctx.staging.take(small.part));
            assert!(third.await.is_ok());
        });
        // A part larger than all the room takes all of it, and does not wait for ever.
        let big = ctx.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(5), ctx.staging.take(10 * small.part)).await.is_ok()
        });
        assert!(big);
    }
}
