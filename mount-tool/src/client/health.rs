//! A live view of every server a mount reads from, and the routing it drives.
//!
//! Each server has counters (requests, failures, bytes, bytes in flight) and an estimate of how fast it
//! delivers (an exponentially weighted mean of each body's bytes per second). A request goes to the
//! server expected to finish it first: its bytes in flight plus this request's, over its rate (servers
//! not yet measured are assumed as fast as the fastest one measured, so each gets tried); ties rotate by
//! the caller's spread (the batch number), so idle servers share the batches.
//!
//! A server that fails (unreachable, stalled, a 5xx answer, a body cut short) is taken out at its first
//! failure for a backoff of 1 s, doubling with each failure in a row up to 30 s. When the backoff has
//! passed, one request at a time probes it: a success puts it back, a failure takes it out again for
//! longer. While every server is out, requests go to the one whose backoff ends first (a retry must
//! try somewhere). A 4xx answer says nothing about health (the request was wrong) and is not counted.
//!
//! A server that sheds load (`503` with `Retry-After`: it is saturated, not failing) is not taken out: it
//! rests for its `Retry-After` (at most 30 s), new requests go to the others meanwhile, and a request that
//! finds every server out and this one back soonest waits for the rest to end before it is sent. Its
//! backoff does not grow, and it needs no probe.
//!
//! A server whose reply named another index of the dataset than the mount's (a replica restarted over
//! other files: not the same dataset) is passed over for [`OTHER_INDEX_FOR`], logged once when found so
//! and once when it serves the mount's index again; after that time one request at a time probes it again
//! (refused at its head, and sent elsewhere, if it still differs). It is passed over even while every
//! other server is out or resting: the one of those back soonest is tried (and waited for, if resting), as
//! when every server is out. Only when every server is known to serve another index is one of them chosen,
//! and the read fails at once.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long a server that serves another index of the dataset is passed over before it is probed again.
pub const OTHER_INDEX_FOR: Duration = Duration::from_secs(30);
/// Weight of the newest body in the rate estimate.
const RATE_WEIGHT: f64 = 0.2;

#[derive(Debug, Default)]
struct Server {
    requests: AtomicU64,
    failures: AtomicU64,
    bytes: AtomicU64,
    in_flight: AtomicU64,
    /// Bytes per second (an f64's bits); 0 until measured.
    rate: AtomicU64,
    /// Out of rotation until this instant (nanoseconds since `started`); 0: in.
    down_until: AtomicU64,
    /// Backoff of the current run of failures (milliseconds); 0 when healthy.
    backoff_ms: AtomicU64,
    /// Times it was taken out.
    taken_out: AtomicU64,
    /// Times it shed a request (`503` with `Retry-After`).
    sheds: AtomicU64,
    /// Resting until this instant after shedding (nanoseconds since `started`); 0: not.
    rest_until: AtomicU64,
    /// Its last reply named another index of the dataset than the mount's (logged when set and cleared).
    other_index: AtomicBool,
    /// Passed over until this instant for serving another index (nanoseconds since `started`); 0: not.
    other_until: AtomicU64,
}

/// Every server's health, in the order of the mount's server list.
#[derive(Debug)]
pub struct Health {
    urls: Vec<String>,
    servers: Vec<Server>,
    started: Instant,
}

/// One server's counters, as `batchfs stats` and the metrics endpoint show them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerSnapshot {
    pub url: String,
    /// In rotation now (false: taken out after a failure, until its backoff ends and a probe succeeds).
    pub up: bool,
    pub requests: u64,
    pub failures: u64,
    pub bytes: u64,
    pub in_flight_bytes: u64,
    /// Delivery rate estimate, MB/s (0 until measured).
    pub mb_per_s: u64,
    /// Times it was taken out of rotation.
    pub taken_out: u64,
    /// Times it answered that it was saturated (`503` with `Retry-After`): rested that long, not failed.
    #[serde(default)]
    pub sheds: u64,
    /// Its last reply named another index of the dataset than the mount's (a replica that indexed other
    /// files): passed over while another server is in rotation, until a reply of the mount's index.
    #[serde(default)]
    pub other_index: bool,
}

/// A request in flight on a server; its bytes leave the server's in-flight count when dropped.
pub struct InFlight<'a> {
    health: &'a Health,
    server: usize,
    bytes: u64,
    started: Instant,
}

impl InFlight<'_> {
    pub fn server(&self) -> usize {
        self.server
    }

    /// The request delivered `bytes` in full.
    pub fn succeeded(self, bytes: u64) {
        let s = &self.health.servers[self.server];
        s.bytes.fetch_add(bytes, Ordering::Relaxed);
        let secs = self.started.elapsed().as_secs_f64();
        // Small bodies measure latency, not rate.
        if bytes >= 256 << 10 && secs > 0.0 {
            let sample = bytes as f64 / secs;
            let old = f64::from_bits(s.rate.load(Ordering::Relaxed));
            let new = if old == 0.0 { sample } else { old * (1.0 - RATE_WEIGHT) + sample * RATE_WEIGHT };
            s.rate.store(new.to_bits(), Ordering::Relaxed);
        }
        // Back in rotation (a probe that succeeded).
        s.backoff_ms.store(0, Ordering::Relaxed);
        s.down_until.store(0, Ordering::Relaxed);
        s.other_until.store(0, Ordering::Relaxed);
        if s.other_index.swap(false, Ordering::Relaxed) {
            let server = &self.health.urls[self.server];
            tracing::warn!(%server, "server serves the mount's index again: back in rotation");
        }
    }

    /// The reply's head named `index_id`, another index of the dataset than `mounted`, the mount's: the
    /// server is passed over for [`OTHER_INDEX_FOR`] (said once, not for each read). Whether another
    /// server may serve the mount's index: one not known to serve another, in rotation now or once its
    /// backoff or rest ends (a server down or resting is waited for, not given up on).
    pub fn other_index(self, index_id: &str, mounted: &str) -> bool {
        let h = self.health;
        let s = &h.servers[self.server];
        s.other_until.store(h.now() + OTHER_INDEX_FOR.as_nanos() as u64, Ordering::Relaxed);
        if !s.other_index.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                server = %h.urls[self.server],
                index = index_id,
                mounted,
                "server serves another index of the dataset (indexed again with other files): reads go to the other \
                 servers while any serves the mount's"
            );
        }
        let now = h.now();
        (0..h.servers.len()).any(|k| k != self.server && !Self::serves_another(&h.servers[k], now))
    }

    /// Whether server `s` is known to serve another index than the mount's now (passed over for it).
    fn serves_another(s: &Server, now: u64) -> bool {
        s.other_until.load(Ordering::Relaxed) > now
    }

    /// The server answered that it is saturated and will take requests again after `retry_after`.
    pub fn shed(self, retry_after: Duration) {
        let s = &self.health.servers[self.server];
        s.sheds.fetch_add(1, Ordering::Relaxed);
        let until = self.health.now() + retry_after.min(MAX_BACKOFF).as_nanos() as u64;
        s.rest_until.fetch_max(until, Ordering::Relaxed);
        tracing::debug!(server = %self.health.urls[self.server], ?retry_after, "server saturated: resting");
    }

    /// The request failed for a reason that is the server's (or the path's).
    pub fn failed(self) {
        let s = &self.health.servers[self.server];
        s.failures.fetch_add(1, Ordering::Relaxed);
        let previous = s.backoff_ms.load(Ordering::Relaxed);
        let backoff =
            if previous == 0 { FIRST_BACKOFF } else { (Duration::from_millis(previous) * 2).min(MAX_BACKOFF) };
        s.backoff_ms.store(backoff.as_millis() as u64, Ordering::Relaxed);
        let until = self.health.now() + backoff.as_nanos() as u64;
        if s.down_until.swap(until, Ordering::Relaxed) <= self.health.now() {
            s.taken_out.fetch_add(1, Ordering::Relaxed);
        }
        tracing::info!(server = %self.health.urls[self.server], ?backoff, "server failed: out of rotation");
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.health.servers[self.server].in_flight.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl Health {
    pub fn new(urls: &[String]) -> Self {
        Health {
            urls: urls.to_vec(),
            servers: urls.iter().map(|_| Server::default()).collect(),
            started: Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        self.started.elapsed().as_nanos() as u64 + 1
    }

    /// The server URL `n`.
    pub fn url(&self, n: usize) -> &str {
        &self.urls[n]
    }

    /// How long server `n` still rests after shedding load, if it does.
    pub fn resting(&self, n: usize) -> Option<Duration> {
        let (until, now) = (self.servers[n].rest_until.load(Ordering::Relaxed), self.now());
        (until > now).then(|| Duration::from_nanos(until - now))
    }

    /// When server `s` takes requests again: the later of its backoff's and its rest's ends.
    fn back_at(s: &Server) -> u64 {
        s.down_until.load(Ordering::Relaxed).max(s.rest_until.load(Ordering::Relaxed))
    }

    /// Starts a request of about `expect` bytes on the server expected to finish it first; `spread`
    /// (e.g. the batch number) rotates ties.
    pub fn begin(&self, spread: usize, expect: u64) -> InFlight<'_> {
        self.begin_on(self.choose(spread, expect), expect)
    }

    /// Starts a request of about `expect` bytes on server `server`, in rotation or not: a retry that asks
    /// the server whose body failed its checksum to recheck what it sent (`client/http.rs`).
    pub fn begin_on(&self, server: usize, expect: u64) -> InFlight<'_> {
        let s = &self.servers[server];
        s.requests.fetch_add(1, Ordering::Relaxed);
        s.in_flight.fetch_add(expect, Ordering::Relaxed);
        InFlight { health: self, server, bytes: expect, started: Instant::now() }
    }

    fn choose(&self, spread: usize, expect: u64) -> usize {
        let n = self.servers.len();
        if n == 1 {
            return 0;
        }
        let now = self.now();
        let fastest = self.servers.iter().map(|s| f64::from_bits(s.rate.load(Ordering::Relaxed))).fold(0.0, f64::max);
        let assumed = if fastest > 0.0 { fastest } else { 1e9 };
        let mut best: Option<(usize, f64)> = None;
        for i in 0..n {
            let k = (spread + i) % n;
            let s = &self.servers[k];
            if Self::back_at(s) > now || InFlight::serves_another(s, now) {
                continue;
            }
            // Recovering (from failures, or from serving another index): one probe at a time.
            let probing = s.backoff_ms.load(Ordering::Relaxed) > 0 || s.other_index.load(Ordering::Relaxed);
            if probing && s.in_flight.load(Ordering::Relaxed) > 0 {
                continue;
            }
            let rate = f64::from_bits(s.rate.load(Ordering::Relaxed));
            let rate = if rate > 0.0 { rate } else { assumed };
            let finish = (s.in_flight.load(Ordering::Relaxed) + expect) as f64 / rate;
            if best.is_none_or(|(_, b)| finish < b) {
                best = Some((k, finish));
            }
        }
        // Everything is out: the one back soonest of those that may serve the mount's index (a server of
        // another index is refused at its head, whenever it is back), else of all.
        let soonest = |k: &usize| {
            let s = &self.servers[*k];
            (InFlight::serves_another(s, now), Self::back_at(s))
        };
        best.map(|(k, _)| k).unwrap_or_else(|| (0..n).min_by_key(soonest).expect("servers"))
    }

    /// Every server's counters now.
    pub fn snapshot(&self) -> Vec<ServerSnapshot> {
        let now = self.now();
        self.servers
            .iter()
            .zip(&self.urls)
            .map(|(s, url)| ServerSnapshot {
                url: url.clone(),
                up: s.down_until.load(Ordering::Relaxed) <= now && s.backoff_ms.load(Ordering::Relaxed) == 0,
                other_index: s.other_index.load(Ordering::Relaxed),
                requests: s.requests.load(Ordering::Relaxed),
                failures: s.failures.load(Ordering::Relaxed),
                bytes: s.bytes.load(Ordering::Relaxed),
                in_flight_bytes: s.in_flight.load(Ordering::Relaxed),
                mb_per_s: (f64::from_bits(s.rate.load(Ordering::Relaxed)) / 1e6).round() as u64,
                taken_out: s.taken_out.load(Ordering::Relaxed),
                sheds: s.sheds.load(Ordering::Relaxed),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(n: usize) -> Health {
        Health::new(&(0..n).map(|i| format!("http://s{i}")).collect::<Vec<_>>())
    }

    #[test]
    fn idle_servers_share_requests_by_spread() {
        let h = health(3);
        let picks: Vec<usize> = (0..6).map(|b| h.begin(b, 1 << 20).server()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn bytes_in_flight_and_rates_steer_requests() {
        let h = health(2);
        let held = h.begin(0, 64 << 20);
        assert_eq!(held.server(), 0);
        // Server 0 is busy with 64 MiB: the next ones go to 1 whatever their spread.
        for b in 0..4 {
            assert_eq!(h.begin(b, 1 << 20).server(), 1);
        }
        drop(held);
        // Server 1 measured ten times faster: it takes the work until its queue outweighs that.
        h.servers[0].rate.store(100e6_f64.to_bits(), Ordering::Relaxed);
        h.servers[1].rate.store(1e9_f64.to_bits(), Ordering::Relaxed);
        let mut held = Vec::new();
        for b in 0..9 {
            let r = h.begin(b, 8 << 20);
            assert_eq!(r.server(), 1, "request {b}");
            held.push(r);
        }
        assert_eq!(h.begin(0, 8 << 20).server(), 0, "80 MB queued at 1 GB/s outweighs 8 MB at 100 MB/s");
    }

    #[test]
    fn a_failed_server_is_out_until_its_backoff_ends_then_probed_one_request_at_a_time() {
        let h = health(2);
        h.begin(0, 1000).failed();
        let s = h.snapshot();
        assert!(!s[0].up && s[1].up && s[0].failures == 1 && s[0].taken_out == 1, "{s:?}");
        for b in 0..4 {
            assert_eq!(h.begin(b, 1000).server(), 1, "out of rotation");
        }
        // The backoff has passed: one probe goes to server 0, and only one while it is in flight.
        h.servers[0].down_until.store(1, Ordering::Relaxed);
        let probe = h.begin(0, 1000);
        assert_eq!(probe.server(), 0);
        assert_eq!(h.begin(0, 1000).server(), 1, "one probe at a time");
        probe.failed();
        assert_eq!(h.servers[0].backoff_ms.load(Ordering::Relaxed), 2000, "the backoff doubles");
        h.servers[0].down_until.store(1, Ordering::Relaxed);
        h.begin(0, 1000).succeeded(1000);
        let s = h.snapshot();
        assert!(s[0].up && s[0].taken_out == 2 && s[0].bytes == 1000, "{s:?}");
    }

    #[test]
    fn a_server_shedding_load_rests_without_being_taken_out() {
        let h = health(2);
        h.begin(0, 1000).shed(Duration::from_secs(5));
        let s = h.snapshot();
        assert!(s[0].up && s[0].failures == 0 && s[0].taken_out == 0 && s[0].sheds == 1, "{s:?}");
        assert!(h.resting(0).is_some_and(|r| r > Duration::from_secs(4)) && h.resting(1).is_none());
        for b in 0..4 {
            assert_eq!(h.begin(b, 1000).server(), 1, "new requests go to the other while it rests");
        }
        h.begin(1, 1000).shed(Duration::from_secs(9));
        assert_eq!(h.begin(1, 1000).server(), 0, "both rest: the one back soonest");
        assert_eq!(h.servers[0].backoff_ms.load(Ordering::Relaxed), 0, "no backoff to grow, no probe needed");
        h.begin(0, 1000).shed(Duration::from_secs(3600));
        assert!(h.resting(0).unwrap() <= MAX_BACKOFF, "a rest is at most {MAX_BACKOFF:?}");
    }

    #[test]
    fn a_server_of_another_index_is_passed_over_then_probed() {
        let h = health(2);
        assert!(h.begin(0, 10).other_index("2", "1"), "server 1 may serve the mount's index");
        for b in 0..4 {
            assert_eq!(h.begin(b, 10).server(), 1, "passed over");
        }
        let s = h.snapshot();
        assert!(s[0].other_index && s[0].failures == 0 && s[0].taken_out == 0 && !s[1].other_index, "{s:?}");
        // Its time passed over ended: probed, one request at a time; a reply of the mount's puts it back.
        h.servers[0].other_until.store(1, Ordering::Relaxed);
        h.servers[1].down_until.store(1, Ordering::Relaxed);
        let probe = h.begin(0, 10);
        assert_eq!(probe.server(), 0);
        assert_eq!(h.begin(0, 10).server(), 1, "one probe at a time");
        probe.succeeded(10);
        assert!(!h.snapshot()[0].other_index);
    }

    /// A stale replica beside a server of the mount's index that failed or sheds load: the request waits
    /// for that server (the one back soonest of those that may serve the mount's index), never goes to the
    /// replica, whose reply says another server may still serve it. Only with every server known to serve
    /// another index is one of them tried, and its reply says none may.
    #[test]
    fn a_server_of_another_index_is_passed_over_while_the_others_are_out_or_resting() {
        let h = health(2);
        assert!(h.begin(0, 10).other_index("2", "1"));
        h.begin(1, 10).failed();
        let now = h.now();
        h.servers[1].down_until.store(now + 20_000_000_000, Ordering::Relaxed);
        let waits = h.begin(0, 10);
        assert_eq!(waits.server(), 1, "server 1, failed, is back before server 0 is probed, and may serve");
        drop(waits);
        assert!(h.begin_on(0, 10).other_index("2", "1"), "server 1 is out, not of another index: waited for");
        h.servers[1].down_until.store(1, Ordering::Relaxed);
        h.servers[1].backoff_ms.store(0, Ordering::Relaxed);
        h.begin(1, 10).shed(Duration::from_secs(1));
        let rests = h.begin(0, 10);
        assert_eq!(rests.server(), 1, "server 1 rests, server 0 serves another index");
        assert!(h.resting(rests.server()).is_some(), "the request waits out its rest");
        drop(rests);
        assert!(h.begin_on(0, 10).other_index("2", "1"), "server 1 rests: waited for");
        // Both of another index: the one back soonest is tried, and says that none may serve.
        assert!(!h.begin_on(1, 10).other_index("3", "1"), "no server may serve the mount's index");
        assert_eq!(h.begin(1, 10).server(), 0, "server 1 rests");
    }

    #[test]
    fn with_every_server_out_the_one_back_soonest_is_tried() {
        let h = health(2);
        h.begin(1, 10).failed();
        assert_eq!(h.begin(1, 10).server(), 0, "server 1 is out");
        let now = h.now();
        h.servers[0].down_until.store(now + 5_000_000_000, Ordering::Relaxed);
        h.servers[1].down_until.store(now + 9_000_000_000, Ordering::Relaxed);
        assert_eq!(h.begin(1, 10).server(), 0, "server 0 comes back first");
    }
}
