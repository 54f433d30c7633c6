//! The window: what to fetch ahead of each reader, and how much may be in flight. A read of a listing is
//! shown to the [`StreamTracker`] (`streams.rs`), whose stream says which files to keep ahead, nearest
//! first; their prefetches start until one finds no room (the window narrows until readers consume what
//! is cached: backpressure). A window that runs past an epoch's end continues into the next epoch, whose
//! manifest a background task fetches (once, however many reads ask). Prefetch bytes in flight are
//! capped by [`prefetch_cap`]: the configured bytes, or what the measured delivery rate brings in half of
//! `stall_timeout`.

use super::listings::NextEpoch;
use super::streams::Target;
use super::{Listing, ObjectKey, Objects, Prefetcher};
use crate::stats::Stats;
use crate::sync::{Arc, Ordering};
use batchfs::encode::BatchFormat;
use std::time::{Duration, Instant};

/// Bytes of prefetches allowed in flight: `configured`, but, once the delivery rate is measured (`rate`,
/// bytes per second, all servers together; 0 before), no more than what it brings in half of
/// `stall_timeout`. More than that, on a link shared by many nodes, leaves some response without a byte
/// for `stall_timeout`: it is abandoned and fetched again, and the link carries it twice. Before the
/// rate is measured (a mount's first second of transfers), the cap starts at an eighth of `configured`
/// and grows with what is delivered (twice the bytes `delivered` so far): a fast link reaches the whole
/// window once half of it has arrived (in a fraction of a second), while many mounts starting together
/// on a narrow link do not all ask for their whole window at once. (One prefetch may always run,
/// whatever the cap.)
pub fn prefetch_cap(configured: u64, rate: f64, delivered: u64, stall_timeout: Duration) -> u64 {
    if rate <= 0.0 {
        return configured.min((configured / 8).max(delivered.saturating_mul(2)));
    }
    configured.min((rate * stall_timeout.as_secs_f64() / 2.0) as u64)
}

/// The delivery rate of fetches, all servers together: bytes delivered per second of time with a fetch
/// in flight, over windows of at least a second of it, smoothed. Time with nothing in flight does not
/// count: a mount idle between two jobs' epochs (a loader rebuilding its pipeline, a validation pass)
/// would otherwise close its window on the next epoch's first delivery with the idle seconds in it,
/// measure a fraction of the link's rate, and cap the next epoch's window to what that fraction brings
/// in, at 30 ms a window too shallow for the round trip: the stalls of short epochs at 30 ms.
#[derive(Debug, Default)]
pub(super) struct Throughput {
    /// Fetches in flight.
    active: u64,
    /// When the present stretch of time with a fetch in flight began.
    busy_since: Option<Instant>,
    /// Time with a fetch in flight in the present window, before `busy_since`.
    busy: Duration,
    bytes: u64,
    /// Bytes per second; 0 until a window has closed.
    pub(super) rate: f64,
    /// Bytes delivered since the mount started.
    pub(super) delivered: u64,
}

impl Throughput {
    const WINDOW: Duration = Duration::from_secs(1);

    /// A fetch starts.
    pub(super) fn started(&mut self, now: Instant) {
        if self.active == 0 {
            self.busy_since = Some(now);
        }
        self.active += 1;
    }

    /// A fetch ends (before or after [`Throughput::record`] of what it delivered, if it did).
    pub(super) fn ended(&mut self, now: Instant) {
        self.active = self.active.saturating_sub(1);
        if self.active == 0 {
            if let Some(since) = self.busy_since.take() {
                self.busy += now.saturating_duration_since(since);
            }
        }
    }

    /// `bytes` delivered by a fetch that ends now.
    pub(super) fn record(&mut self, bytes: u64, now: Instant) {
        self.bytes += bytes;
        self.delivered += bytes;
        let busy = self.busy + self.busy_since.map_or(Duration::ZERO, |s| now.saturating_duration_since(s));
        if busy >= Self::WINDOW {
            let sample = self.bytes as f64 / busy.as_secs_f64();
            self.rate = if self.rate == 0.0 { sample } else { 0.5 * self.rate + 0.5 * sample };
            self.bytes = 0;
            self.busy = Duration::ZERO;
            if self.busy_since.is_some() {
                self.busy_since = Some(now);
            }
        }
    }
}

impl Prefetcher {
    /// Starts the window of the stream this read belongs to.
    pub(super) fn prefetch_after(self: &Arc<Self>, key: ObjectKey, objects: &Objects, owner: u32) {
        // shuffled/'s classes have windows of their own (fs/shuffled.rs asks for them).
        if self.config.prefetch == 0 || matches!(key.listing, Listing::Shuffled { .. }) {
            return;
        }
        if let Listing::Raw { dir } = key.listing {
            let indexes: Vec<Target> = (self.raw.indexes_at(dir, key.index).into_iter())
                .map(|index| Target { listing: key.listing, index })
                .collect();
            self.start_prefetches(&indexes, objects);
        }
        let targets = self.streams.lock().expect("streams").observe(
            owner,
            key.listing,
            key.index,
            objects.len(),
            self.window(key.listing, objects),
        );
        let (here, next): (Vec<Target>, Vec<Target>) = targets.into_iter().partition(|t| t.listing == key.listing);
        if !self.start_prefetches(&here, objects) {
            return;
        }
        // The window runs into the next epoch: its manifest may not be here yet, and fetching it must
        // not hold up this read. (rolling/'s indexed files are placed from the epoch's TFRecord batches,
        // and their twins are the same for every epoch.)
        let Some(&Target { listing: next_listing, .. }) = next.first() else { return };
        let (epoch, format, twins_too) = match next_listing {
            Listing::Epoch { epoch, format } => (epoch, format, true),
            Listing::Rolling { epoch } => (epoch, BatchFormat::Tfrecord, false),
            Listing::Raw { .. } | Listing::Shuffled { .. } => return,
        };
        if epoch > self.config.last_epoch {
            return;
        }
        let NextEpoch { cached, twins } = self.listings.next_epoch(epoch, format);
        let twins = twins.filter(|_| twins_too);
        if let (Some(m), None) = (&cached, twins) {
            self.start_prefetches(&next, &Objects::Batches(m.clone()));
            return;
        }
        // One task per next epoch: the reads near an epoch's end would each start one, and each would
        // fetch the same manifests. Reads after it ends find them cached.
        if !self.listings.start_warming(next_listing) {
            return;
        }
        let this = self.clone();
        self.runtime.spawn(async move {
            // Starting a prefetch takes the cache lock only briefly and never waits.
            let m = match cached {
                Some(m) => Ok(m),
                None => this.fetch_manifest(epoch, format).await,
            };
            if let Ok(m) = m {
                this.start_prefetches(&next, &Objects::Batches(m));
            }
            if let Some(idx) = twins {
                if let Ok(m) = this.fetch_manifest(epoch, idx).await {
                    let all: Vec<Target> = (0..m.batches.len() as u64)
                        .map(|index| Target { listing: Listing::Epoch { epoch, format: idx }, index })
                        .collect();
                    this.start_prefetches(&all, &Objects::Batches(m));
                }
            }
            this.listings.warmed(next_listing);
        });
    }

    /// The window of a stream over a listing's `objects`, in files: `prefetch`, or, for an epoch's batches,
    /// as many as hold `prefetch_bytes` at the listing's mean size when that is more (at most 16 ×
    /// `prefetch`, so tiny batches do not become thousands of requests, and never more than the listing).
    /// `raw/` files keep `prefetch`: a file tree's files are single samples.
    pub(super) fn window(&self, listing: Listing, objects: &Objects) -> usize {
        let prefetch = self.config.prefetch;
        if let Listing::Raw { .. } = listing {
            return prefetch;
        }
        let n = objects.len();
        let mean = (objects.bytes() / n.max(1)).max(1);
        let by_bytes = self.config.prefetch_bytes.div_ceil(mean).min(n) as usize;
        prefetch.max(by_bytes.min(prefetch.saturating_mul(16)))
    }

    /// Starts the prefetch of each target (of the listing of `objects`) not cached or in flight, in order,
    /// until one finds no room (the window narrows until readers consume what is cached); false then.
    pub(super) fn start_prefetches(self: &Arc<Self>, targets: &[Target], objects: &Objects) -> bool {
        for target in targets {
            let key = ObjectKey { listing: target.listing, index: target.index };
            let Ok(obj) = self.object(key, objects) else { continue };
            match self.get_or_start(key, &obj, false, Instant::now()) {
                Ok(Some((_, true))) => Stats::add(&self.stats.prefetches, 1),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return false,
            }
        }
        true
    }

    /// Bytes of prefetches allowed in flight now ([`prefetch_cap`] of the measured rate).
    pub(super) fn prefetch_cap(&self) -> u64 {
        let (rate, delivered) = {
            let t = self.throughput.lock().expect("throughput");
            (t.rate, t.delivered)
        };
        let cap = prefetch_cap(self.config.max_prefetch_bytes, rate, delivered, self.config.stall_timeout);
        self.stats.delivery_rate.store(rate as u64, Ordering::Relaxed);
        self.stats.prefetch_cap.store(cap, Ordering::Relaxed);
        cap
    }
}
