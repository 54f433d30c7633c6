//! A narrow link: a mount's first read shares the link with the window's first prefetches, and the
//! server sends their frames in turn, so every body of that first burst takes about as long as all of
//! them together, past `timeout` and, per stream, past `stall_timeout`. None of that is an outage: the
//! read waits on while bytes come, and no stream is given up and asked again over the same link.

use crate::common::{self, fixture, runtime, serve, ServeWith};
use batchfs::crc;
use batchfs::index::SourceFormat;
use batchfs_lab::netem::{start, Link, QUEUE};
use std::time::{Duration, Instant};

#[test]
fn a_first_read_behind_the_first_prefetches_on_a_narrow_link_waits_on_while_bytes_come() {
    let rt = runtime();
    // 8 batches of ~4 MB (frames of 1 MiB); a new mount asks for an eighth of `max_prefetch_bytes`
    // (32 MB) at once: the whole epoch, ~6 s at 40 Mbit/s, sent in turn.
    let fx = fixture(SourceFormat::Tfrecord, 64, 500_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let m = common::manifest_of(&rt, &server, "d", 0, "batch_size=8");
    let epoch_bytes: u64 = m.batches.iter().map(|b| b.bytes).sum();
    let link = Link { one_way: Duration::from_millis(1), jitter: Duration::ZERO, rate: Some(5e6), queue: QUEUE };
    let netem = start("127.0.0.1:0".parse().unwrap(), server.running.local_addr(), link).unwrap();
    let url = format!("http://{}/d", netem.addr);
    let (_dir, mounted) = common::mount_url(&url, "batch_size=8,timeout=2s,stall_timeout=1s");
    let epoch = mounted.mountpoint.join("epoch-0000");
    let started = Instant::now();
    let first = std::fs::read(epoch.join("batch-000000.tfrecord")).expect("a read on a busy link is no outage");
    let waited = started.elapsed();
    assert_eq!((first.len() as u64, crc::crc32c(&first)), (m.batches[0].bytes, m.batches[0].crc32c));
    // The case this test is about: the read outlasted its `timeout` behind the other bodies.
    assert!(waited > Duration::from_secs(2), "the first read took {waited:?}: no burst to wait behind");
    for (b, batch) in m.batches.iter().enumerate().skip(1) {
        let body = std::fs::read(epoch.join(format!("batch-{b:06}.tfrecord"))).unwrap();
        assert_eq!((body.len() as u64, crc::crc32c(&body)), (batch.bytes, batch.crc32c), "batch {b}");
    }
    let stats = common::mount_stats(&mounted.mountpoint);
    assert_eq!((stats["retries"].as_u64(), stats["errors"].as_u64()), (Some(0), Some(0)), "{stats}");
    // Nothing asked twice: the link carried the epoch once (the next epoch's first prefetches aside).
    let fetched = stats["fetched_bytes"].as_u64().unwrap();
    assert!(fetched >= epoch_bytes, "{fetched} of {epoch_bytes}");
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

/// The server's socket holds at most `unsent_bytes` unsent: a response asked for while another's
/// megabytes go out on the same connection gets its head after a frame or two of them, not after all
/// the socket would otherwise hold (its send buffer grows to 4 MB on loopback: 4 s at 8 Mbit/s).
#[test]
fn a_response_on_a_busy_narrow_connection_is_not_queued_behind_megabytes_of_another() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 500_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let link = Link { one_way: Duration::from_millis(1), jitter: Duration::ZERO, rate: Some(1e6), queue: QUEUE };
    let netem = start("127.0.0.1:0".parse().unwrap(), server.running.local_addr(), link).unwrap();
    let batch = |b| format!("http://{}{}?batch_size=8", netem.addr, batchfs::api::batch_path("d", 0, b));
    let head_after = rt.block_on(async {
        let client = reqwest::Client::builder()
            .http2_prior_knowledge()
            .http2_initial_stream_window_size(16 << 20)
            .http2_initial_connection_window_size(64 << 20)
            .build()
            .unwrap();
        let first = client.get(batch(0)).send().await.unwrap();
        // Its ~4 MB fill whatever the server's socket takes meanwhile.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let started = Instant::now();
        let second = client.get(batch(1)).send().await.unwrap();
        let head_after = started.elapsed();
        assert!(first.status().is_success() && second.status().is_success());
        head_after
    });
    // 512 KiB unsent and a 1 MiB frame under way: ~1.6 s at 1 MB/s; unbounded, 3.5-4.5 s.
    assert!(head_after < Duration::from_millis(2500), "the second head came after {head_after:?}");
    rt.block_on(server.running.shutdown());
}
