//! One fetch, from its admission to its publication: the cache admits the object (or another reader's
//! fetch of it is joined), the [`Fetcher`] (`fetcher.rs`) fetches its body, and what it fetched is
//! published on the entry, counted, and fed to the window's delivery rate; a failed fetch drops the
//! entry, its charge with it.

use super::cache::{Admitted, Ask, Prefetching};
use super::entry::{Entry, State};
use super::fetcher::{Fetched, Job};
use super::{Object, ObjectKey, Objects, Prefetcher, ReadError};
use crate::stats::Stats;
use crate::sync::{Arc, Ordering};
use std::time::Instant;

impl Prefetcher {
    /// The cache entry of `key`, starting its fetch if it is absent: `(entry, started now)`. A prefetch
    /// (`on_demand == false`) gets `None` when its bytes do not fit; a read evicts or waits for room.
    pub(super) fn get_or_start(
        self: &Arc<Self>,
        key: ObjectKey,
        (objects, obj): (&Arc<dyn Objects>, &Object),
        on_demand: bool,
        deadline: Instant,
    ) -> Result<Option<(Arc<Entry>, bool)>, ReadError> {
        // With passthrough a body the kernel may serve whole goes straight into a memory file: charged,
        // with no buffer. A placed file is made from its body in a buffer, and a part of a file (a group
        // of `shuffled/`'s samples, a chunk of a large `raw/` file) is only ever read through the daemon.
        let memfd = self.fetcher.memfds() && obj.placed.is_none() && obj.whole;
        let cap = if on_demand { u64::MAX } else { self.window.cap() };
        let ask = Ask { charge: obj.charge(), sent: obj.sent.bytes, memfd, on_demand, cap, deadline };
        Ok(match self.cache.admit(key, ask)? {
            None => None,
            Some(Admitted::Joined(entry)) => Some((entry, false)),
            Some(Admitted::Started { entry, buffer, recycled, prefetching }) => {
                Stats::add(&self.stats.in_flight, 1);
                self.window.fetch_started();
                let room = (buffer, recycled);
                self.spawn_fetch(key, (objects, obj.clone()), entry.clone(), room, prefetching);
                Some((entry, true))
            }
        })
    }

    /// Fetches `obj` (cached under `key` as `entry`, charged already) on the runtime, by the [`Fetcher`]:
    /// into `buffer` (the admission's, reused memory) or, without one, straight into a memory file (the
    /// idle one `recycled`, when the admission found one). A
    /// prefetch brings the guard that counts it in flight, dropped when the fetch ends. Then counts the
    /// bytes, feeds the window's delivery rate, and publishes the body, or on failure drops the entry (its
    /// charge with it).
    fn spawn_fetch(
        self: &Arc<Self>,
        key: ObjectKey,
        (objects, obj): (&Arc<dyn Objects>, Object),
        entry: Arc<Entry>,
        (buffer, recycled): (Option<Vec<u8>>, Option<std::fs::File>),
        prefetching: Option<Prefetching>,
    ) {
        let on_disk = self.fetcher.node_cache().and_then(|_| objects.on_disk(key.index, &obj));
        let (sent, placed) = (obj.sent, obj.placed);
        let job = Job { key, request: objects.request(key.index), sent, placed, on_disk, buffer, recycled };
        let this = self.clone();
        self.runtime.spawn(async move {
            let result = this.fetcher.fetch(job, &entry, this.cache.pool()).await;
            this.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            drop(prefetching);
            // What the node cache gave came from no link: not a delivery.
            let delivered = result.as_ref().ok().filter(|f| !f.from_disk).map(|_| sent.bytes);
            this.window.fetch_ended(delivered);
            match result {
                Ok(Fetched { content, file, from_disk }) => {
                    if !from_disk {
                        Stats::add(&this.stats.fetched_bytes, sent.bytes);
                    }
                    if let Some(file) = file {
                        Stats::add(&this.stats.passthrough_bytes, content.stored());
                        *entry.memfd.lock().expect("memfd") = Some(file);
                    }
                    entry.set(State::Ready(content));
                }
                Err(e) => {
                    tracing::warn!(what = %key, error = %e, "fetch failed");
                    entry.set(State::Failed(e));
                    // Its charge goes back with it.
                    this.cache.failed(key, &entry);
                }
            }
            this.cache.changed();
        });
    }
}
