//! Admission into the cache: an object's bytes are charged to the budget before its fetch starts, as a
//! [`Charge`] that the cache holds beside its entry and that gives the bytes back when it is dropped (the
//! entry evicted, or its fetch failed): no release is paired by hand. A prefetch is admitted only when it
//! fits under the prefetch cap and in the budget after evicting consumed or stale batches; a read evicts
//! more, or waits for room until its deadline.

use super::cache::{Cache, Cached, Entry};
use super::window::Prefetching;
use super::{describe, Object, ObjectKey, Prefetcher, ReadError};
use crate::buffers::{Admission, BufferPool};
use crate::stats::Stats;
use crate::sync::{Arc, MutexGuard, Ordering};
use std::time::{Duration, Instant};

/// Bytes of the budget charged for one cache entry, given back when dropped.
pub(super) struct Charge {
    pool: Arc<BufferPool>,
    stats: Arc<Stats>,
    bytes: u64,
}

impl Charge {
    /// Takes on `bytes` the pool has just charged.
    fn new(pool: &Arc<BufferPool>, stats: &Arc<Stats>, bytes: u64) -> Self {
        stats.cache_bytes.store(pool.used(), Ordering::Relaxed);
        Charge { pool: pool.clone(), stats: stats.clone(), bytes }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.pool.release(self.bytes);
        self.stats.cache_bytes.store(self.pool.used(), Ordering::Relaxed);
    }
}

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
        let need = obj.charge();
        let mut cache = self.cache.lock().expect("cache");
        let (buffer, charge) = loop {
            if let Some(e) = cache.entries.get(&key) {
                if !e.entry.is_failed() {
                    return Ok(Some((e.entry.clone(), false)));
                }
                // A fetch that gave up, not yet cleaned up by its task (which leaves alone an entry that is
                // no longer its own): it makes way for a new one, its charge given back.
                cache.entries.pop(&key);
                continue;
            }
            // Checked under the cache lock, so concurrent prefetchers cannot overshoot the limit.
            let prefetching = self.prefetching.load(Ordering::Relaxed);
            if !on_demand && prefetching > 0 && prefetching + obj.sent.bytes > self.prefetch_cap() {
                return Ok(None);
            }
            // Idle buffers count in the budget: the pool admits the fetch, or frees one of them and
            // asks to try again, before any cached batch is evicted.
            let admission = if memfd { self.pool.charge(need as usize) } else { self.pool.admit(need as usize) };
            match admission {
                Admission::Fits { buffer, charge } => break (buffer, Charge::new(&self.pool, &self.stats, charge)),
                Admission::Trimmed => continue,
                Admission::Full => {}
            }
            if need > self.config.cache_bytes {
                return Err(ReadError::CacheTooSmall {
                    what: describe(key),
                    size: need,
                    budget: self.config.cache_bytes,
                });
            }
            // An evicted batch's buffer joins the pool (unless a reader still holds a slice of it),
            // where the next round reuses it or frees it.
            if let Some(victim) = cache.victim(self.clock(), self.config.stale_after, on_demand) {
                self.evict(&mut cache, victim);
                continue;
            }
            if !on_demand {
                return Ok(None);
            }
            cache = self.wait_for_room(cache, deadline)?;
        };
        let entry = Arc::new(Entry::new(self.clock()));
        cache.entries.put(key, Cached { _charge: charge, entry: entry.clone() });
        // Counted with the cache lock still held, as it was checked: no admission passes the check on a
        // count that another has passed it on but not raised yet.
        let prefetching = (!on_demand).then(|| Prefetching::count(&self.prefetching, obj.sent.bytes));
        drop(cache);
        Stats::add(&self.stats.in_flight, 1);
        self.throughput.lock().expect("throughput").started(std::time::Instant::now());
        self.spawn_fetch(key, obj.clone(), entry.clone(), buffer, memfd, prefetching);
        Ok(Some((entry, true)))
    }

    /// Drops `key` from the cache now (an object no reader will ask for again), if it is there and its
    /// memory file is not open.
    pub(super) fn forget(&self, key: ObjectKey) {
        let mut cache = self.cache.lock().expect("cache");
        if cache.entries.peek(&key).is_some_and(|c| c.entry.is_ready() && !c.entry.is_pinned()) {
            self.evict(&mut cache, key);
            drop(cache);
            self.room.notify_all();
        }
    }

    /// Drops `key` from the cache: its charge goes back to the budget, then its buffer (unless a reader
    /// still holds a slice of it) to the pool, into the room just released.
    fn evict(&self, cache: &mut Cache, key: ObjectKey) {
        if cache.entries.pop(&key).is_some() {
            Stats::add(&self.stats.evictions, 1);
        }
    }

    fn wait_for_room<'a>(
        &self,
        cache: MutexGuard<'a, Cache>,
        deadline: Instant,
    ) -> Result<MutexGuard<'a, Cache>, ReadError> {
        let now = Instant::now();
        if now >= deadline {
            return Err(ReadError::Timeout { after: self.config.timeout, last: "no room in the cache".into() });
        }
        // Woken when a fetch ends (a batch becomes evictable or its reservation is released).
        Ok(self.room.wait_timeout(cache, (deadline - now).min(Duration::from_millis(100))).expect("cache").0)
    }
}
