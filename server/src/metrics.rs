//! Server metrics, exported at `GET /metrics` in the Prometheus text format. Every name is a constant
//! here and documented in `docs/METRICS.md`.

use batchfs::prometheus::Exposition;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub const REQUESTS_TOTAL: &str = "batchfs_requests_total";
pub const RESPONSE_BYTES_TOTAL: &str = "batchfs_response_bytes_total";
pub const ERRORS_TOTAL: &str = "batchfs_errors_total";
pub const IN_FLIGHT: &str = "batchfs_requests_in_flight";
pub const FRAMING_BYTES: &str = "batchfs_framing_bytes";
pub const LATENCY_SECONDS: &str = "batchfs_request_latency_seconds";
pub const STORAGE_READS_TOTAL: &str = "batchfs_storage_blocking_reads_total";
pub const WARMED_BATCHES_TOTAL: &str = "batchfs_readahead_batches_total";
pub const CONNECTIONS_TOTAL: &str = "batchfs_connections_total";
pub const CONNECTIONS_OPEN: &str = "batchfs_connections_open";
pub const SENDFILE_BYTES_TOTAL: &str = "batchfs_sendfile_bytes_total";
pub const MANIFESTS_COMPUTED_TOTAL: &str = "batchfs_manifests_computed_total";
/// 1 when shards of a dataset changed under the server.
pub const DATASET_CHANGED: &str = "batchfs_dataset_changed";
/// An object dataset's reads of its bucket (`objects.rs`).
pub const OBJECT_GETS_TOTAL: &str = "batchfs_object_gets_total";
pub const OBJECT_BYTES_TOTAL: &str = "batchfs_object_bytes_total";
pub const OBJECT_CACHE_HIT_BYTES_TOTAL: &str = "batchfs_object_cache_hit_bytes_total";
pub const OBJECT_BAD_CHECKSUMS_TOTAL: &str = "batchfs_object_bad_checksums_total";
pub const OBJECT_GET_RETRIES_TOTAL: &str = "batchfs_object_get_retries_total";
pub const OBJECT_READ_FAILURES_TOTAL: &str = "batchfs_object_read_failures_total";
pub const OBJECT_TIER_HIT_BYTES_TOTAL: &str = "batchfs_object_tier_hit_bytes_total";
pub const OBJECT_TIER_DIRECT_BYTES_TOTAL: &str = "batchfs_object_tier_direct_bytes_total";
/// The disk tier of object datasets (`objects/tier.rs`), server-wide.
pub const TIER_BYTES: &str = "batchfs_tier_bytes";
pub const TIER_CAPACITY_BYTES: &str = "batchfs_tier_capacity_bytes";
pub const TIER_EVICTED_OPEN_BYTES: &str = "batchfs_tier_evicted_open_bytes";
pub const TIER_OBJECTS: &str = "batchfs_tier_objects";
pub const TIER_HITS_TOTAL: &str = "batchfs_tier_hits_total";
pub const TIER_HIT_BYTES_TOTAL: &str = "batchfs_tier_hit_bytes_total";
pub const TIER_STAGED_TOTAL: &str = "batchfs_tier_staged_objects_total";
pub const TIER_FETCHED_BYTES_TOTAL: &str = "batchfs_tier_fetched_bytes_total";
pub const TIER_EVICTED_TOTAL: &str = "batchfs_tier_evicted_objects_total";
pub const TIER_FAILURES_TOTAL: &str = "batchfs_tier_failures_total";
pub const TIER_RECHECKS_TOTAL: &str = "batchfs_tier_rechecks_total";
pub const TIER_RECHECK_DROPPED_TOTAL: &str = "batchfs_tier_recheck_dropped_total";
pub const TIER_RECHECKS_REFUSED_TOTAL: &str = "batchfs_tier_rechecks_refused_total";

/// The per-dataset counters, in the text format: `(dataset, manifests computed, shards changed, the
/// object source's counters)` for each dataset.
pub fn render_datasets<'a>(
    datasets: impl Iterator<Item = (&'a str, u64, usize, Option<&'a crate::objects::ObjectCounters>)> + Clone,
) -> String {
    let mut out = Exposition::new();
    out.family(
        MANIFESTS_COMPUTED_TOTAL,
        "counter",
        "Epoch manifests computed (not served from the cache), by dataset.",
    );
    for (name, computed, _, _) in datasets.clone() {
        out.sample(MANIFESTS_COMPUTED_TOTAL, &[("dataset", name)], computed);
    }
    out.family(
        DATASET_CHANGED,
        "gauge",
        "1 when shards of the dataset changed under the server (they are refused), by dataset.",
    );
    for (name, _, shards_changed, _) in datasets.clone() {
        out.sample(DATASET_CHANGED, &[("dataset", name)], u8::from(shards_changed > 0));
    }
    type Counter = fn(&crate::objects::ObjectCounters) -> &AtomicU64;
    let objects: [(&str, &str, Counter); 8] = [
        (OBJECT_GETS_TOTAL, "Ranged GET requests sent to the bucket, by object dataset.", |c| &c.gets),
        (OBJECT_BYTES_TOTAL, "Bytes read from the bucket, by object dataset.", |c| &c.bytes),
        (
            OBJECT_CACHE_HIT_BYTES_TOTAL,
            "Bytes served from the block cache instead of the bucket, by object dataset.",
            |c| &c.cache_hit_bytes,
        ),
        (
            OBJECT_BAD_CHECKSUMS_TOTAL,
            "Ranges the bucket returned that failed the index's checksum (read again), by object dataset.",
            |c| &c.bad_checksums,
        ),
        (
            OBJECT_GET_RETRIES_TOTAL,
            "GETs that failed on the way (the store's client's own retries spent, or a body cut short) and were \
             made again, by object dataset.",
            |c| &c.retried_gets,
        ),
        (
            OBJECT_READ_FAILURES_TOTAL,
            "Reads of the bucket given up after object_retry_for (the bodies that needed them cut), by object \
             dataset.",
            |c| &c.failed_reads,
        ),
        (
            OBJECT_TIER_HIT_BYTES_TOTAL,
            "Bytes served from copies in the disk tier instead of the bucket, by object dataset.",
            |c| &c.tier_hit_bytes,
        ),
        (
            OBJECT_TIER_DIRECT_BYTES_TOTAL,
            "Of the bytes served from the disk tier, those read by the direct path of local shards (O_DIRECT).",
            |c| &c.tier_direct_bytes,
        ),
    ];
    if datasets.clone().any(|d| d.3.is_some()) {
        for (metric, help, counter) in objects {
            out.family(metric, "counter", help);
            for (name, _, _, counters) in datasets.clone() {
                if let Some(c) = counters {
                    out.sample(metric, &[("dataset", name)], counter(c).load(Ordering::Relaxed));
                }
            }
        }
    }
    out.finish()
}

/// The disk tier's gauges and counters, in the text format (nothing without a tier).
pub fn render_tier(tier: Option<&crate::objects::tier::Tier>) -> String {
    let Some(tier) = tier else { return String::new() };
    let mut out = Exposition::new();
    let gauges = [
        (TIER_BYTES, "Bytes of disk the copies the disk tier holds occupy.", tier.bytes()),
        (TIER_CAPACITY_BYTES, "The most bytes the disk tier holds (disk_cache_size).", tier.cap()),
        (
            TIER_EVICTED_OPEN_BYTES,
            "Bytes of disk of evicted copies read still, counted until closed.",
            tier.gone_bytes(),
        ),
        (TIER_OBJECTS, "Copies the disk tier holds.", tier.copies() as u64),
    ];
    for (metric, help, value) in gauges {
        out.family(metric, "gauge", help);
        out.sample(metric, &[], value);
    }
    let c = &tier.counters;
    let counters = [
        (TIER_HITS_TOTAL, "Reads served from copies in the disk tier.", &c.hits),
        (TIER_HIT_BYTES_TOTAL, "Bytes served from copies in the disk tier.", &c.hit_bytes),
        (TIER_STAGED_TOTAL, "Objects copied into the disk tier.", &c.staged),
        (TIER_FETCHED_BYTES_TOTAL, "Bytes read from the store to copy objects into the disk tier.", &c.fetched_bytes),
        (TIER_EVICTED_TOTAL, "Copies evicted from the disk tier to make room.", &c.evicted),
        (TIER_FAILURES_TOTAL, "Copies lost to a failing disk, or removed for differing from the index.", &c.failures),
        (TIER_RECHECKS_TOTAL, "Copies whose ranges a client's recheck had read against the index.", &c.rechecked),
        (TIER_RECHECK_DROPPED_TOTAL, "Copies dropped as a recheck found their bytes differing.", &c.recheck_dropped),
        (TIER_RECHECKS_REFUSED_TOTAL, "Rechecks refused: as many running as recheck_concurrency.", &c.recheck_refused),
    ];
    for (metric, help, counter) in counters {
        out.family(metric, "counter", help);
        out.sample(metric, &[], counter.load(Ordering::Relaxed));
    }
    out.finish()
}

/// The kinds of request counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Batch,
    Manifest,
    File,
    Other,
}

impl Kind {
    const ALL: [Kind; 4] = [Kind::Batch, Kind::Manifest, Kind::File, Kind::Other];

    fn label(self) -> &'static str {
        match self {
            Kind::Batch => "batch",
            Kind::Manifest => "manifest",
            Kind::File => "file",
            Kind::Other => "other",
        }
    }
}

/// Upper bounds (seconds) of the latency histogram's buckets: time from request to response head.
const BUCKETS: [f64; 12] = [0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0];

/// The server's counters.
#[derive(Default)]
pub struct Metrics {
    requests: [AtomicU64; 4],
    pub response_bytes: AtomicU64,
    errors: [AtomicU64; ERROR_STATUSES.len()],
    pub in_flight: AtomicU64,
    /// Memory the layouts of bodies in flight hold (`framing.rs`).
    pub framing_bytes: AtomicU64,
    latency_buckets: [AtomicU64; BUCKETS.len()],
    latency_count: AtomicU64,
    latency_sum_ns: AtomicU64,
    pub storage_reads: AtomicU64,
    pub warmed_batches: AtomicU64,
    pub connections_total: AtomicU64,
    pub connections_open: AtomicU64,
    /// Body bytes sent from their file (`sendfile`, see `sendfile.rs`).
    pub sendfile_bytes: AtomicU64,
}

/// Status codes counted as errors, each under its own label; another 4xx counts as 400, another 5xx as 500.
const ERROR_STATUSES: [u16; 9] = [400, 401, 404, 405, 409, 412, 416, 500, 503];

impl Metrics {
    /// Counts a request of `kind` answered with `status` after `latency`.
    pub fn record(&self, kind: Kind, status: u16, latency: Duration) {
        self.requests[kind as usize].fetch_add(1, Ordering::Relaxed);
        if status >= 400 {
            let or = if status < 500 { 400 } else { 500 };
            let slot = ERROR_STATUSES
                .iter()
                .position(|&s| s == status)
                .or_else(|| ERROR_STATUSES.iter().position(|&s| s == or));
            let slot = slot.expect("400 and 500 are listed");
            self.errors[slot].fetch_add(1, Ordering::Relaxed);
        }
        let secs = latency.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|&b| secs <= b) {
            self.latency_buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.latency_count.fetch_add(1, Ordering::Relaxed);
        self.latency_sum_ns.fetch_add(latency.as_nanos() as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = Exposition::new();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.family(REQUESTS_TOTAL, "counter", "Requests answered, by kind.");
        for kind in Kind::ALL {
            out.sample(REQUESTS_TOTAL, &[("kind", kind.label())], get(&self.requests[kind as usize]));
        }
        out.metric(RESPONSE_BYTES_TOTAL, "counter", "Body bytes sent.", get(&self.response_bytes));
        out.family(ERRORS_TOTAL, "counter", "Error responses, by status (400 counts other 4xx, 500 other 5xx).");
        for (i, status) in ERROR_STATUSES.iter().enumerate() {
            out.sample(ERRORS_TOTAL, &[("status", &status.to_string())], get(&self.errors[i]));
        }
        out.metric(
            IN_FLIGHT,
            "gauge",
            "Bodies not yet sent in full (batches, files, large JSON documents).",
            get(&self.in_flight),
        );
        out.metric(
            FRAMING_BYTES,
            "gauge",
            "Memory the layouts of the bodies in flight hold (framing and segments; limit framing_memory).",
            get(&self.framing_bytes),
        );
        out.family(LATENCY_SECONDS, "histogram", "Time from request to response head.");
        let bucket = format!("{LATENCY_SECONDS}_bucket");
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += get(&self.latency_buckets[i]);
            out.sample(&bucket, &[("le", &bound.to_string())], cumulative);
        }
        let count = get(&self.latency_count);
        out.sample(&bucket, &[("le", "+Inf")], count);
        out.sample(&format!("{LATENCY_SECONDS}_sum"), &[], get(&self.latency_sum_ns) as f64 / 1e9);
        out.sample(&format!("{LATENCY_SECONDS}_count"), &[], count);
        for (name, help, kind, value) in [
            (
                STORAGE_READS_TOTAL,
                "Reads of storage in the storage semaphore: body chunks not resident or not mapped, and warming.",
                "counter",
                &self.storage_reads,
            ),
            (
                WARMED_BATCHES_TOTAL,
                "Batches whose storage ranges were warmed ahead of their request.",
                "counter",
                &self.warmed_batches,
            ),
            (CONNECTIONS_TOTAL, "Connections accepted.", "counter", &self.connections_total),
            (CONNECTIONS_OPEN, "Connections open.", "gauge", &self.connections_open),
            (
                SENDFILE_BYTES_TOTAL,
                "Body bytes sent from their file by sendfile(2) (limit sendfile), not copied out of a mapping.",
                "counter",
                &self.sendfile_bytes,
            ),
        ] {
            out.metric(name, kind, help, get(value));
        }
        out.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counts_and_histogram() {
        let m = Metrics::default();
        m.record(Kind::Batch, 200, Duration::from_micros(300));
        m.record(Kind::Batch, 404, Duration::from_millis(2));
        m.record(Kind::File, 503, Duration::from_secs(9));
        let text = m.render();
        assert!(text.contains("batchfs_requests_total{kind=\"batch\"} 2"), "{text}");
        assert!(text.contains("batchfs_errors_total{status=\"404\"} 1"));
        // A saturated server's 503, a changed shard's 409 and a refused method's 405 were counted as 500s.
        assert!(text.contains("batchfs_errors_total{status=\"503\"} 1"));
        assert!(text.contains("batchfs_errors_total{status=\"500\"} 0"));
        for (status, label) in [(409, "409"), (405, "405"), (412, "412"), (418, "400"), (502, "500")] {
            m.record(Kind::Other, status, Duration::ZERO);
            assert!(m.render().contains(&format!("batchfs_errors_total{{status=\"{label}\"}} 1")), "{status}");
        }
        assert!(text.contains("batchfs_request_latency_seconds_bucket{le=\"0.0005\"} 1"));
        assert!(text.contains("batchfs_request_latency_seconds_bucket{le=\"0.0025\"} 2"));
        assert!(text.contains("batchfs_request_latency_seconds_bucket{le=\"+Inf\"} 3"));
    }

    #[test]
    fn the_grafana_dashboard_uses_only_exported_metrics() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/grafana/batchfs-server.json");
        let dashboard = std::fs::read_to_string(path).unwrap();
        let json: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
        assert!(!json["panels"].as_array().unwrap().is_empty());
        let exported = Metrics::default().render();
        let mut used = 0;
        for (i, _) in dashboard.match_indices("batchfs_") {
            let name: String = dashboard[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let family = name.strip_suffix("_bucket").unwrap_or(&name);
            assert!(exported.contains(&format!("# TYPE {family} ")), "the dashboard uses {name}, not exported");
            used += 1;
        }
        assert!(used >= 8, "{used} metric uses");
    }
}
