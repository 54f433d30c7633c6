//! The mount's Prometheus endpoint (the `metrics=ADDR` option, off by default): `GET /metrics` on ADDR
//! answers the counters of `.batchfs/stats` and each server's health in the Prometheus text format
//! 0.0.4. A plain HTTP/1.1 responder on one thread: a scrape every few seconds needs nothing more, and
//! the mount stays free of an HTTP server stack.

use crate::client::health::ServerSnapshot;
use crate::stats::{Stats, StatsSnapshot};
use batchfs::prometheus::Exposition;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// Serves `/metrics` on `addr` from a background thread; returns the address bound (port 0 picks one).
pub fn serve(addr: SocketAddr, stats: Arc<Stats>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let local = listener.local_addr()?;
    std::thread::Builder::new().name("batchfs-metrics".into()).spawn(move || {
        for conn in listener.incoming().flatten() {
            if let Err(e) = answer(conn, &stats) {
                tracing::debug!(error = %e, "metrics request failed");
            }
        }
    })?;
    tracing::info!(%local, "metrics endpoint: GET /metrics");
    Ok(local)
}

fn answer(mut conn: TcpStream, stats: &Stats) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 << 10 {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => ("200 OK", render(&stats.snapshot())),
        ("GET", _) => ("404 Not Found", "GET /metrics\n".to_owned()),
        _ => ("405 Method Not Allowed", "GET /metrics\n".to_owned()),
    };
    let len = body.len();
    write!(conn, "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {len}\r\n")?;
    write!(conn, "Connection: close\r\n\r\n{body}")
}

/// One per-server value of a snapshot.
type PerServer = fn(&ServerSnapshot) -> u64;

/// The counters as Prometheus text: `batchfs_mount_*`, and `batchfs_mount_server_*{server="URL"}`.
pub fn render(s: &StatsSnapshot) -> String {
    let mut out = Exposition::new();
    // Every single-valued metric, in the order they are written: the mount's, the node cache's, warming's.
    let mut whole: Vec<(&str, &str, &str, u64)> = vec![
        ("bytes_served_total", "counter", "Bytes returned to readers.", s.bytes_served),
        ("reads_total", "counter", "Reads answered by the daemon.", s.reads),
        ("hits_total", "counter", "Reads and passthrough opens whose file was cached or in flight.", s.hits),
        ("misses_total", "counter", "Reads and passthrough opens that started their file's fetch.", s.misses),
        ("stalls_total", "counter", "Reads and passthrough opens that waited for a fetch.", s.stalls),
        ("fetches_in_flight", "gauge", "Fetches in flight.", s.in_flight),
        ("cache_bytes", "gauge", "Bytes held or reserved by the cache.", s.cache_bytes),
        ("prefetches_total", "counter", "Fetches started ahead of a reader.", s.prefetches),
        ("fetched_bytes_total", "counter", "Bytes received from servers.", s.fetched_bytes),
        ("retries_total", "counter", "Fetch attempts retried after a failure.", s.retries),
        ("checksum_errors_total", "counter", "Bodies refetched after a size or CRC32C mismatch.", s.checksum_errors),
        ("errors_total", "counter", "Reads and opens answered EIO.", s.errors),
        ("evictions_total", "counter", "Batches dropped from the cache.", s.evictions),
        ("passthrough_opens_total", "counter", "Opens served by FUSE passthrough.", s.passthrough_opens),
        ("recycled_bytes_total", "counter", "Bytes received into memory files filled again.", s.recycled_bytes),
        ("daemon_opens_total", "counter", "Opens read through the daemon.", s.daemon_opens),
        ("lookups_total", "counter", "Names the daemon looked up.", s.lookups),
        ("ring_opens_total", "counter", "Opens the kernel sent over a FUSE ring (fuse_uring).", s.ring_opens),
        ("ring_kicks_total", "counter", "Requests the FUSE rings' watchdog sent to free a CPU's queue.", s.ring_kicks),
        ("early_reads_total", "counter", "Daemon reads answered before their batch had all arrived.", s.early_reads),
        ("shuffled_window_groups", "gauge", "Groups each class's window of shuffled/ spans now.", s.shuffled_window),
        ("prefetch_bytes_in_flight", "gauge", "Bytes of prefetches in flight.", s.prefetch_bytes_in_flight),
        ("prefetch_cap_bytes", "gauge", "The cap on bytes of prefetches in flight.", s.prefetch_cap),
        ("delivery_rate_bytes", "gauge", "Measured delivery rate, bytes per second in flight.", s.delivery_rate),
    ];
    if let Some(n) = &s.node_cache {
        whole.extend([
            ("node_cache_bytes", "gauge", "Bytes in the node cache (cache_dir).", n.bytes),
            ("node_cache_hits_total", "counter", "Objects read from the node cache instead of the network.", n.hits),
            ("node_cache_hit_bytes_total", "counter", "Bytes read from the node cache.", n.hit_bytes),
            ("node_cache_written_bytes_total", "counter", "Bytes written to the node cache.", n.written_bytes),
            ("node_cache_corrupt_total", "counter", "Node cache files found corrupt and fetched anew.", n.corrupt),
            ("node_cache_unread_total", "counter", "Node cache opens that found the file as last checked.", n.unread),
        ]);
    }
    if s.supervisor_pid != 0 {
        whole.extend([
            (
                "worker_restarts_total",
                "counter",
                "Workers started after the first: each a takeover.",
                s.worker_restarts,
            ),
            ("last_takeover_microseconds", "gauge", "Time without service of the last takeover.", s.last_takeover_us),
        ]);
    }
    if let Some(w) = &s.warm {
        whole.extend([
            ("warm_files", "gauge", "Files warmed into the node cache so far.", w.files),
            ("warm_files_total", "gauge", "Files warming fills the node cache with.", w.files_total),
            ("warm_bytes", "gauge", "Bytes warmed into the node cache so far.", w.bytes),
            ("warm_bytes_total", "gauge", "Bytes warming fills the node cache with.", w.bytes_total),
        ]);
    }
    for (name, kind, help, value) in whole {
        out.metric(&format!("batchfs_mount_{name}"), kind, help, value);
    }
    // In seconds with their fraction: in whole seconds, a rate of sub-second stalls read 0.
    let stalled = s.stall_us as f64 / 1e6;
    out.metric("batchfs_mount_stall_seconds_total", "counter", "Time readers waited, seconds.", stalled);
    let per_server: [(&str, &str, &str, PerServer); 7] = [
        ("up", "gauge", "1 while the server is in rotation.", |v| u64::from(v.up)),
        ("requests_total", "counter", "Requests sent to the server.", |v| v.requests),
        ("failures_total", "counter", "Requests that failed for the server's reasons.", |v| v.failures),
        ("sheds_total", "counter", "Requests the server shed, saturated (503 with Retry-After).", |v| v.sheds),
        ("bytes_total", "counter", "Body bytes received in full from the server.", |v| v.bytes),
        ("in_flight_bytes", "gauge", "Bytes of requests in flight on the server.", |v| v.in_flight_bytes),
        ("rate_bytes_per_second", "gauge", "The server's delivery rate estimate.", |v| v.mb_per_s * 1_000_000),
    ];
    for (name, kind, help, get) in per_server {
        let name = format!("batchfs_mount_server_{name}");
        out.family(&name, kind, help);
        for v in &s.servers {
            out.sample(&name, &[("server", &v.url)], get(v));
        }
    }
    out.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::health::Health;

    #[test]
    fn scrapes_the_counters_and_each_servers_health() {
        let stats = Arc::new(Stats::default());
        Stats::add(&stats.reads, 7);
        let health = Arc::new(Health::new(&["http://a:1".to_owned(), "http://b:2".to_owned()]));
        health.begin(1, 100).failed();
        stats.feed(move |s| s.servers = health.snapshot());
        let addr = serve("127.0.0.1:0".parse().unwrap(), stats).unwrap();
        let get = |path: &str| {
            let mut conn = TcpStream::connect(addr).unwrap();
            write!(conn, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut text = String::new();
            conn.read_to_string(&mut text).unwrap();
            text
        };
        let text = get("/metrics");
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(text.contains("\nbatchfs_mount_reads_total 7\n"), "{text}");
        assert!(text.contains("\nbatchfs_mount_server_up{server=\"http://a:1\"} 1\n"), "{text}");
        assert!(text.contains("\nbatchfs_mount_server_up{server=\"http://b:2\"} 0\n"), "{text}");
        assert!(text.contains("\nbatchfs_mount_server_failures_total{server=\"http://b:2\"} 1\n"), "{text}");
        assert!(get("/other").starts_with("HTTP/1.1 404"));
    }

    /// The node cache's and warming's metrics follow the mount's, each with its type, only when there
    /// is a node cache or warming.
    #[test]
    fn node_cache_and_warming_metrics_appear_with_them() {
        let mut snap = StatsSnapshot { reads: 3, stall_us: 31_797, ..Default::default() };
        assert!(!render(&snap).contains("node_cache") && !render(&snap).contains("warm_"));
        // Stalls in seconds with their fraction (whole seconds read 0 for every sub-second stall).
        assert!(render(&snap).contains("\nbatchfs_mount_stall_seconds_total 0.031797\n"), "{}", render(&snap));
        snap.node_cache = Some(crate::stats::NodeCacheSnapshot { bytes: 11, corrupt: 2, ..Default::default() });
        snap.warm = Some(crate::stats::WarmSnapshot { files: 4, files_total: 9, ..Default::default() });
        let text = render(&snap);
        for line in [
            "# TYPE batchfs_mount_node_cache_bytes gauge\nbatchfs_mount_node_cache_bytes 11\n",
            "# TYPE batchfs_mount_node_cache_corrupt_total counter\nbatchfs_mount_node_cache_corrupt_total 2\n",
            "# TYPE batchfs_mount_warm_files gauge\nbatchfs_mount_warm_files 4\n",
            "# TYPE batchfs_mount_warm_files_total gauge\nbatchfs_mount_warm_files_total 9\n",
        ] {
            assert!(text.contains(line), "{line:?} in {text}");
        }
        assert!(!text.contains("worker_restarts"), "an unsupervised mount has no takeovers to count");
        snap.supervisor_pid = 40;
        snap.worker_restarts = 3;
        snap.last_takeover_us = 6100;
        let text = render(&snap);
        assert!(text
            .contains("# TYPE batchfs_mount_worker_restarts_total counter\nbatchfs_mount_worker_restarts_total 3\n"));
        assert!(text.contains("\nbatchfs_mount_last_takeover_microseconds 6100\n"), "{text}");
        let at = |name: &str| text.find(name).unwrap();
        assert!(at("batchfs_mount_reads_total") < at("node_cache_bytes") && at("node_cache_bytes") < at("warm_files"));
    }
}
