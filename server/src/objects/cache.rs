//! The block cache of object datasets: checked units, by dataset and unit, least recently used evicted
//! past `object_cache` bytes, shared by every object dataset of a server ([`super::ObjectContext`]). A
//! unit being fetched is in it too, as the fetch to wait for, so two bodies that want it read the bucket
//! once.

use super::units::{coalesce, Unit};
use super::{ObjectSource, ReadError};
use bytes::Bytes;
use futures_util::future::{BoxFuture, FutureExt, Shared};
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// A unit's bytes, once fetched and checked (or the fetch's failure), shared by everyone waiting on it.
type Pending = Shared<BoxFuture<'static, Result<Bytes, Arc<str>>>>;

/// The block cache of object datasets: checked units by dataset and unit, least recently used
/// evicted past `object_cache` bytes. A unit being fetched is in it too, as the fetch to wait for.
pub struct BlockCache {
    inner: Mutex<CacheInner>,
}

struct CacheInner {
    units: lru::LruCache<(u64, Unit), (u64, Pending)>,
    bytes: u64,
    cap: u64,
}

impl BlockCache {
    /// An empty cache of at most `cap` bytes.
    pub fn new(cap: u64) -> Self {
        BlockCache { inner: Mutex::new(CacheInner { units: lru::LruCache::unbounded(), bytes: 0, cap }) }
    }

    /// Whether reading `bytes` ahead into the cache is worth it: only while it can hold them several
    /// times over (8), or the units read ahead would be evicted, under the bodies' own traffic, before
    /// the bodies that want them come, and read twice.
    pub fn worth_reading_ahead(&self, bytes: u64) -> bool {
        bytes.saturating_mul(8) <= self.inner.lock().expect("cache").cap
    }

    /// Bytes of the units held (or being fetched).
    pub fn bytes(&self) -> u64 {
        self.inner.lock().expect("cache").bytes
    }
}

impl CacheInner {
    fn evict(&mut self) {
        while self.bytes > self.cap {
            match self.units.pop_lru() {
                Some((_, (len, _))) => self.bytes -= len,
                None => break,
            }
        }
    }
}

impl BlockCache {
    /// Each unit's bytes: from the cache, from a fetch already running, or fetched now (coalesced).
    pub(super) async fn get_or_fetch(
        &self,
        source: &Arc<ObjectSource>,
        units: &[Unit],
    ) -> Result<Vec<Bytes>, ReadError> {
        for round in 0..2 {
            let mut waits: Vec<Pending> = Vec::with_capacity(units.len());
            let mut senders = Vec::new();
            {
                let mut inner = self.inner.lock().expect("cache");
                for (i, u) in units.iter().enumerate() {
                    let key = (source.id, *u);
                    if let Some((_, pending)) = inner.units.get(&key) {
                        waits.push(pending.clone());
                        continue;
                    }
                    let (tx, rx) = tokio::sync::oneshot::channel::<Result<Bytes, Arc<str>>>();
                    let pending: Pending =
                        async move { rx.await.unwrap_or_else(|_| Err(Arc::from("the fetch was dropped"))) }
                            .boxed()
                            .shared();
                    inner.units.put(key, (u.len, pending.clone()));
                    inner.bytes += u.len;
                    waits.push(pending);
                    senders.push((i, tx));
                }
                inner.evict();
            }
            // Fetch what is ours, coalesced; everyone else waits on the same pending entries.
            let ours: Vec<Unit> = senders.iter().map(|(i, _)| units[*i]).collect();
            // Where each of ours is among `waits` (its entry, to tell from one made after it was evicted).
            let (at, mut senders): (Vec<usize>, Vec<Option<tokio::sync::oneshot::Sender<_>>>) =
                senders.into_iter().map(|(i, tx)| (i, Some(tx))).unzip();
            let reads = coalesce(&ours, source.limits().gap, source.limits().part);
            let fetched =
                futures_util::future::join_all(reads.iter().map(|r| source.fetch(r, &ours[r.first..r.past]))).await;
            let mut failure = None;
            for (read, result) in reads.iter().zip(fetched) {
                match result {
                    Ok(slices) => {
                        for (k, bytes) in (read.first..read.past).zip(slices) {
                            if let Some(tx) = senders[k].take() {
                                let _ = tx.send(Ok(bytes));
                            }
                        }
                    }
                    Err(e) => {
                        let text: Arc<str> = Arc::from(match &e {
                            ReadError::Changed { why, .. } => why.clone(),
                            ReadError::Io(e) => e.to_string(),
                        });
                        let mut inner = self.inner.lock().expect("cache");
                        for k in read.first..read.past {
                            // Only our own entry: once ours was evicted, another body may have put one of
                            // its own there, whose fetch is not ours to undo.
                            let key = (source.id, ours[k]);
                            if inner.units.peek(&key).is_some_and(|(_, p)| p.ptr_eq(&waits[at[k]])) {
                                let (len, _) = inner.units.pop(&key).expect("peeked");
                                inner.bytes -= len;
                            }
                            if let Some(tx) = senders[k].take() {
                                let _ = tx.send(Err(text.clone()));
                            }
                        }
                        failure.get_or_insert(e);
                    }
                }
            }
            if let Some(e) = failure {
                return Err(e);
            }
            let mut out = Vec::with_capacity(units.len());
            let mut waited = 0u64;
            let mut retry = false;
            for pending in waits {
                match pending.await {
                    Ok(bytes) => {
                        waited += bytes.len() as u64;
                        out.push(bytes);
                    }
                    // Another body's fetch failed: fetch it ourselves (once).
                    Err(_) if round == 0 => {
                        retry = true;
                        break;
                    }
                    Err(why) => return Err(ReadError::Io(io::Error::other(why.to_string()))),
                }
            }
            if !retry {
                let fetched: u64 = ours.iter().map(|u| u.len).sum();
                source.counters.cache_hit_bytes.fetch_add(waited.saturating_sub(fetched), Ordering::Relaxed);
                return Ok(out);
            }
        }
        unreachable!("the second round returns")
    }
}
