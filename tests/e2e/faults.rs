//! The prefetcher over the real HTTP/2 client and a real server, with failures injected in front of the
//! client (`FaultClient`, the mount's `testing` feature): a refusal fails a read at once, an outage is
//! retried until the server answers again, and what is read is the server's bytes.

use crate::common::*;
use batchfs::encode::BatchFormat;
use batchfs::index::SourceFormat;
use batchfs_mount::client::{Failure, FaultClient, HttpClient, HttpConfig};
use batchfs_mount::fs::views::epochs::batches;
use batchfs_mount::prefetch::{Prefetcher, PrefetcherConfig, ReadError};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn refusals_fail_at_once_and_outages_are_retried_through_to_the_servers_bytes() {
    let fx = fixture(SourceFormat::Tfrecord, 1_000, 2_000);
    let rt = runtime();
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let http = HttpClient::new(HttpConfig {
        servers: vec![server.base.clone()],
        dataset: "d".into(),
        query: Default::default(),
        token: None,
        connections: 2,
        ca_file: None,
        stall_timeout: Duration::from_secs(10),
        keepalive: Duration::from_secs(15),
        connect_timeout: Duration::from_secs(5),
        frame_size: 128 << 10,
    })
    .unwrap();
    let client = Arc::new(FaultClient::new(http));
    let config = PrefetcherConfig { prefetch: 0, timeout: Duration::from_secs(20), ..Default::default() };
    let p = Prefetcher::new(client.clone(), rt.handle().clone(), config);
    let read = |batch| p.read(batches::key(0, batch, BatchFormat::Tfrecord), 0, u32::MAX, 1);

    client.fail_next([Failure::Status(403)]);
    assert!(matches!(read(0), Err(ReadError::Refused(_))), "a refusal is not retried");

    // An outage of 6 attempts (some 3 s of backoff): the read waits it out, well within its timeout.
    client.fail_next(std::iter::repeat_n(Failure::Unreachable, 6));
    let started = Instant::now();
    let got = read(1).unwrap();
    assert_eq!(got, batch_body(&rt, &server, 0, 1, ""), "the server's bytes, after the outage");
    assert_eq!(client.failed.load(std::sync::atomic::Ordering::Relaxed), 7);
    assert!(p.stats.snapshot().retries >= 6, "{:?}", p.stats.snapshot());
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(read(0).unwrap(), batch_body(&rt, &server, 0, 0, ""), "the refused batch, asked again");
}
