//! One fetch's attempts: a body is checked against the manifest, and a failed attempt is retried with
//! jittered exponential backoff until it succeeds, fails for good (a refusal that cannot change), or the
//! prefetcher's `timeout` has passed since the first attempt.

use super::ObjectKey;
use super::{PrefetcherConfig, ReadError};
use crate::client::Sent;
use crate::client::{Body, ClientError};
use crate::stats::Stats;
use batchfs::plan::SplitMix64;
use std::time::{Duration, Instant};

/// A failed attempt.
pub(super) enum Failure {
    Client(ClientError),
    Mismatch(String),
    /// The memory a body goes into could not be had (a memory file not made or grown): tried again.
    Memory(std::io::Error),
    /// What no retry can mend: the fetch fails with this at once.
    Fatal(ReadError),
}

/// Checks a body against the manifest. Its CRC32C was computed from the bytes as they were stored in
/// the buffer, which nothing writes to afterwards.
pub(super) fn verify(key: ObjectKey, meta: &Sent, body: &Body) -> Result<(), Failure> {
    match meta.mismatch(body) {
        Some(why) => Err(Failure::Mismatch(format!("{key}: {why}"))),
        None => Ok(()),
    }
}

/// The failure of a request for `what` that failed with `e`: where a server's reply named another index
/// than the mount's (`mounted`: the dataset's name and its index id) and no server may serve the mount's
/// ([`ClientError::OtherIndex`]), the dataset indexed again ([`ReadError::Changed`], naming the server):
/// no retry mends it.
pub(super) fn other_index((dataset, was): (&str, &str), what: &str, e: ClientError) -> Failure {
    let changed = match &e {
        ClientError::OtherIndex { server, index_id } => {
            super::changed(dataset, was, index_id, &format!("{what} from {server}"))
        }
        _ => None,
    };
    changed.map_or(Failure::Client(e), Failure::Fatal)
}

/// Runs `attempt` until it succeeds, fails for good, or `config.timeout` has passed, sleeping a jittered
/// exponential backoff (50 ms doubling to 2 s, ×0.5–1.5, cut to the time left) between attempts.
pub(super) async fn with_retries<T, F, Fut>(
    config: &PrefetcherConfig,
    stats: &Stats,
    mut attempt: F,
) -> Result<T, ReadError>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<T, Failure>>,
{
    let started = Instant::now();
    let mut n = 0u32;
    let mounted = (config.dataset.as_str(), config.index_id.as_str());
    loop {
        let failed = match attempt(n).await {
            Ok(v) => return Ok(v),
            Err(Failure::Client(e @ ClientError::OtherIndex { .. })) => other_index(mounted, "a reply", e),
            Err(f) => f,
        };
        let last = match failed {
            Failure::Client(e) if !e.is_retryable() => return Err(ReadError::Refused(e.to_string())),
            Failure::Fatal(e) => return Err(e),
            Failure::Client(e) => e.to_string(),
            Failure::Memory(e) => format!("no memory file for the body: {e}"),
            Failure::Mismatch(m) => {
                Stats::add(&stats.checksum_errors, 1);
                m
            }
        };
        let elapsed = started.elapsed();
        if elapsed >= config.timeout {
            return Err(ReadError::Timeout { after: config.timeout, last });
        }
        // The last attempt is made at the deadline, so an outage shorter than `timeout` is survived.
        let base = Duration::from_millis(50).saturating_mul(1 << n.min(6)).min(Duration::from_secs(2));
        let backoff = base.mul_f64(0.5 + jitter()).min(config.timeout - elapsed);
        tracing::debug!(attempt = n, error = %last, ?backoff, "retrying");
        Stats::add(&stats.retries, 1);
        tokio::time::sleep(backoff).await;
        n += 1;
    }
}

/// A uniform number in [0, 1) for backoff jitter: the plan's SplitMix64, one per thread, seeded apart.
fn jitter() -> f64 {
    use std::hash::BuildHasher;
    thread_local! {
        static RNG: std::cell::RefCell<SplitMix64> =
            std::cell::RefCell::new(SplitMix64::new(std::collections::hash_map::RandomState::new().hash_one(0u8)));
    }
    RNG.with(|r| (r.borrow_mut().next_u64() >> 11) as f64 / (1u64 << 53) as f64)
}
