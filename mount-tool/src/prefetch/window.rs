//! The window, a part of its own: what to fetch ahead of each reader, and how much may be in flight. A
//! read of a listing is shown to the [`StreamTracker`] (`streams.rs`), whose stream says which files to
//! keep ahead, nearest first ([`Window::ahead`]), as many as [`Window::width`] gives; the prefetcher starts
//! them until one finds no room (the window narrows until readers consume what is cached: backpressure).
//! A window that runs past an epoch's end continues into the next epoch. Prefetch bytes in flight are
//! capped by [`Window::cap`] ([`prefetch_cap`]): the configured bytes, or what the measured delivery rate
//! ([`Throughput`], fed by each fetch's start and end) brings in half of `stall_timeout`. It knows no
//! cache, client or runtime: the prefetcher asks it and starts what it says.

use super::kinds::Follow;
use super::streams::{StreamTracker, Target};
use super::{Listing, Objects, PrefetcherConfig};
use crate::stats::Stats;
use crate::sync::{Arc, Mutex, Ordering};
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

/// The window of one mount: its readers' streams and the delivery rate of its fetches.
#[derive(Debug)]
pub(super) struct Window {
    /// Files kept ahead of each stream (0: no prefetch), and the bytes that may make it more.
    prefetch: usize,
    prefetch_bytes: u64,
    /// Bytes of prefetches in flight at most, and the client's stall timeout (the cap's measure).
    max_prefetch_bytes: u64,
    stall_timeout: Duration,
    streams: Mutex<StreamTracker>,
    /// How fast fetches deliver, all together.
    pub(super) throughput: Mutex<Throughput>,
    stats: Arc<Stats>,
}

/// The files to keep ahead of a read, nearest first: in the listing read, and in the next one (an epoch's
/// window running past its end); and the files of the listing read among the first of their stream
/// ([`super::streams::Observed::firsts`]).
#[derive(Debug, Default, PartialEq)]
pub(super) struct Ahead {
    pub here: Vec<Target>,
    pub next: Vec<Target>,
    pub firsts: Vec<u64>,
}

impl Window {
    /// The window of `config`'s settings, reporting its rate and cap in `stats`.
    pub fn new(config: &PrefetcherConfig, stats: Arc<Stats>) -> Self {
        Window {
            prefetch: config.prefetch,
            prefetch_bytes: config.prefetch_bytes,
            max_prefetch_bytes: config.max_prefetch_bytes,
            stall_timeout: config.stall_timeout,
            streams: Mutex::new(StreamTracker::new(config.max_streams, config.max_stride)),
            throughput: Mutex::new(Throughput::default()),
            stats,
        }
    }

    /// Whether a read of a listing followed so has anything fetched ahead of it: not without prefetch, nor
    /// where its view keeps windows of its own (`shuffled/`'s classes).
    pub fn applies_to(&self, follow: Follow) -> bool {
        self.prefetch != 0 && follow.streams
    }

    /// What to keep ahead of a read of file `index` of `listing` (of `objects`, followed so) by `owner`:
    /// nothing where it [does not apply](Window::applies_to).
    pub fn ahead(&self, owner: u32, listing: Listing, index: u64, objects: &Arc<dyn Objects>, follow: Follow) -> Ahead {
        if !self.applies_to(follow) {
            return Ahead::default();
        }
        let width = self.width(follow, objects);
        let mut streams = self.streams.lock().expect("streams");
        let observed = streams.observe(owner, listing, (index, objects.count()), width, follow);
        drop(streams);
        let (here, next) = observed.targets.into_iter().partition(|t| t.listing == listing);
        Ahead { here, next, firsts: observed.firsts }
    }

    /// The window of a stream over a listing's `objects`, in files: `prefetch`, or, followed
    /// [by bytes](Follow::by_bytes) (an epoch's batches), as many as hold `prefetch_bytes` at the listing's
    /// mean size when that is more (at most 16 × `prefetch`, so tiny batches do not become thousands of
    /// requests, and never more than the listing).
    pub fn width(&self, follow: Follow, objects: &Arc<dyn Objects>) -> usize {
        let prefetch = self.prefetch;
        if !follow.by_bytes {
            return prefetch;
        }
        let n = objects.count();
        let mean = (objects.bytes() / n.max(1)).max(1);
        let by_bytes = self.prefetch_bytes.div_ceil(mean).min(n) as usize;
        prefetch.max(by_bytes.min(prefetch.saturating_mul(16)))
    }

    /// Bytes of prefetches allowed in flight now ([`prefetch_cap`] of the measured rate), reported in the
    /// stats with the rate.
    pub fn cap(&self) -> u64 {
        let (rate, delivered) = {
            let t = self.throughput.lock().expect("throughput");
            (t.rate, t.delivered)
        };
        let cap = prefetch_cap(self.max_prefetch_bytes, rate, delivered, self.stall_timeout);
        self.stats.delivery_rate.store(rate as u64, Ordering::Relaxed);
        self.stats.prefetch_cap.store(cap, Ordering::Relaxed);
        cap
    }

    /// A fetch starts.
    pub fn fetch_started(&self) {
        self.throughput.lock().expect("throughput").started(Instant::now());
    }

    /// A fetch ends, having delivered `bytes` (none if it failed, or found its object on the node's disk).
    pub fn fetch_ended(&self, bytes: Option<u64>) {
        let mut throughput = self.throughput.lock().expect("throughput");
        if let Some(bytes) = bytes {
            throughput.record(bytes, Instant::now());
        }
        throughput.ended(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::views::epochs::batches::{self as epochs, Batches};
    use crate::fs::views::{raw::chunks::CHUNKS, shuffled::groups::GROUPS};
    use batchfs::api::{BatchEntry, Manifest};
    use batchfs::encode::BatchFormat;

    const TF: BatchFormat = BatchFormat::Tfrecord;

    /// The batches of `epoch`: `n` of `bytes` each.
    fn batches(epoch: u64, n: u64, bytes: u64) -> Arc<dyn Objects> {
        let batches = (0..n).map(|index| BatchEntry { index, samples: 1, bytes, crc32c: 0 }).collect();
        let (dataset, options, format) = ("d".into(), Default::default(), TF);
        Arc::new(Batches(Arc::new(Manifest {
            dataset,
            epoch,
            options,
            format,
            samples: n,
            bytes: n * bytes,
            batches,
            index_id: String::new(),
        })))
    }

    impl Window {
        /// [`Window::ahead`] of a read followed as its view says.
        fn see(&self, owner: u32, listing: Listing, index: u64, objects: &Arc<dyn Objects>) -> Ahead {
            self.ahead(owner, listing, index, objects, listing.kind.follow(listing))
        }

        /// [`Window::width`] of a listing followed as its view says.
        fn width_of(&self, listing: Listing, objects: &Arc<dyn Objects>) -> usize {
            self.width(listing.kind.follow(listing), objects)
        }
    }

    fn window(prefetch: usize, prefetch_bytes: u64) -> Window {
        let config = PrefetcherConfig { prefetch, prefetch_bytes, ..Default::default() };
        Window::new(&config, Arc::new(Stats::default()))
    }

    fn at(epoch: u64, indexes: std::ops::Range<u64>) -> Vec<Target> {
        indexes.map(|index| Target { listing: epochs::listing(epoch, TF), index }).collect()
    }

    #[test]
    fn the_cap_follows_the_delivery_rate_measured_while_fetches_are_in_flight() {
        let stall = Duration::from_secs(10);
        let mb = 1 << 20;
        assert_eq!(prefetch_cap(256 * mb, 0.0, 0, stall), 32 * mb, "unmeasured, nothing delivered: an eighth");
        assert_eq!(prefetch_cap(256 * mb, 0.0, 40 * mb, stall), 80 * mb, "unmeasured: twice what came");
        assert_eq!(prefetch_cap(256 * mb, 0.0, 900 * mb, stall), 256 * mb, "never past the configured window");
        assert_eq!(prefetch_cap(256 * mb, 1e9, 0, stall), 256 * mb, "a fast link: the configured window");
        assert_eq!(prefetch_cap(256 * mb, 5e6, 9 * mb, stall), 25_000_000, "a share of a narrow link: 5 s of it");
        let mut t = Throughput::default();
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        // One fetch in flight from 0 on, delivering as it goes (a stream of fetches, one after another).
        t.started(at(0));
        t.record(1_000_000, at(0));
        assert_eq!(t.rate, 0.0, "no window closed yet");
        t.record(1_000_000, at(500));
        t.record(2_000_000, at(2000));
        assert_eq!(t.rate, 2_000_000.0, "4 MB over 2 s");
        t.record(4_000_000, at(3000));
        assert_eq!(t.rate, 3_000_000.0, "smoothed with the next window's 4 MB/s");
        assert_eq!(t.delivered, 8_000_000);
        // Half a second more, then nothing in flight for a minute (the loader rebuilds its pipeline):
        // the next epoch's first second of fetches is measured alone, at the link's rate, not as 5 MB
        // over 61 s.
        t.record(1_000_000, at(3500));
        t.ended(at(3500));
        t.started(at(63_500));
        t.record(2_000_000, at(63_800));
        t.ended(at(63_800));
        assert_eq!(t.rate, 3_000_000.0, "idle time is not a window");
        t.started(at(64_000));
        t.record(1_000_000, at(64_200));
        assert_eq!(t.rate, 3_500_000.0, "4 MB over the window's 1 s in flight (0.5 + 0.3 + 0.2), smoothed");
        t.ended(at(64_200));
    }

    #[test]
    fn a_first_read_gets_the_whole_window_which_runs_on_into_the_next_epoch() {
        let w = window(4, 0);
        let (epoch0, listing) = (batches(0, 10, 1000), epochs::listing(0, TF));
        // No first batches to keep: no loader was seen to wrap around at an epoch's end.
        assert_eq!(w.see(1, listing, 0, &epoch0), Ahead { here: at(0, 1..5), next: vec![], firsts: vec![] });
        // Reading on, the window keeps four ahead; near the end it runs past the last batch into epoch 1.
        // (A jump is a random read, which starts nothing: the reads go on in order.)
        assert_eq!(w.see(1, listing, 1, &epoch0).here.last(), Some(&at(0, 5..6)[0]));
        for index in 2..8 {
            w.see(1, listing, index, &epoch0);
        }
        let near_end = w.see(1, listing, 8, &epoch0);
        assert_eq!(near_end, Ahead { here: at(0, 9..10), next: at(1, 0..3), firsts: vec![] });
    }

    #[test]
    fn no_prefetch_and_shuffled_ask_for_nothing_and_raw_files_keep_prefetch() {
        let listing = epochs::listing(0, TF);
        assert_eq!(window(0, 0).see(1, listing, 0, &batches(0, 10, 1000)), Ahead::default());
        let shuffled = Listing::new(&GROUPS, 0, 3);
        assert_eq!(window(4, 0).see(1, shuffled, 0, &batches(0, 10, 1000)), Ahead::default());
        // Small batches: a window as deep in bytes as `prefetch_bytes` (at most 16 x `prefetch`, never more
        // than the listing); a directory of raw/ keeps `prefetch`.
        let w = window(4, 20_000);
        assert_eq!(w.width_of(listing, &batches(0, 100, 1000)), 20);
        assert_eq!(w.width_of(listing, &batches(0, 100, 10)), 64);
        assert_eq!(w.width_of(listing, &batches(0, 10, 10)), 10);
        assert_eq!(w.width_of(listing, &batches(0, 100, 1 << 20)), 4);
        assert_eq!(w.width_of(Listing::new(&CHUNKS, 0, 0), &batches(0, 100, 10)), 4);
    }

    #[test]
    fn the_cap_starts_at_an_eighth_grows_with_what_is_delivered_and_is_reported() {
        let stats = Arc::new(Stats::default());
        let mb = 1 << 20;
        let config = PrefetcherConfig { max_prefetch_bytes: 256 * mb, ..Default::default() };
        let w = Window::new(&config, stats.clone());
        assert_eq!(w.cap(), 32 * mb);
        w.fetch_started();
        w.fetch_ended(Some(40 * mb));
        assert_eq!(w.cap(), 80 * mb, "twice what came");
        // A failed fetch delivers nothing.
        w.fetch_started();
        w.fetch_ended(None);
        assert_eq!(w.cap(), 80 * mb);
        assert_eq!(stats.prefetch_cap.load(Ordering::Relaxed), 80 * mb);
        assert_eq!(w.throughput.lock().unwrap().active, 0, "every start ended");
    }

    /// Readers asking for their windows while fetches start and end on other threads, under Shuttle's
    /// scheduler (PCT, depth 3): every start is ended, every delivered byte counted once, and the cap never
    /// above the configured bytes, in every schedule tried.
    #[cfg(feature = "shuttle")]
    #[test]
    fn shuttle_readers_and_fetches_share_the_window() {
        shuttle::check_pct(
            || {
                let mb = 1 << 20;
                let config = PrefetcherConfig {
                    prefetch: 4,
                    prefetch_bytes: 0,
                    max_prefetch_bytes: 64 * mb,
                    ..Default::default()
                };
                let w = Arc::new(Window::new(&config, Arc::new(Stats::default())));
                let threads: Vec<_> = (0..3u32)
                    .map(|t| {
                        let w = w.clone();
                        shuttle::thread::spawn(move || {
                            let listing = epochs::listing(0, TF);
                            let objects = batches(0, 10, mb);
                            for index in 0..3 {
                                let ahead = w.see(t, listing, index, &objects);
                                assert!(ahead.here.len() + ahead.next.len() <= 4);
                                w.fetch_started();
                                assert!(w.cap() <= 64 * mb);
                                w.fetch_ended((index != 1).then_some(mb));
                            }
                        })
                    })
                    .collect();
                threads.into_iter().for_each(|t| t.join().unwrap());
                let t = w.throughput.lock().unwrap();
                assert_eq!((t.active, t.delivered), (0, 6 * mb));
            },
            1000,
            3,
        );
    }
}
