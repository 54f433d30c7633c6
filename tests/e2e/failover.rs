//! Replicas (`servers=`) of which one was indexed again with other files under a mount (restarted over
//! another tree): every body says the index it was served from in its head, so the mount refuses that
//! replica's bodies as their heads arrive and reads from the replicas that still serve its index, waiting
//! for one that is down as for any fault; only with every replica serving another index does a read fail
//! with `EIO` at once, not after `timeout`, and no reader ever gets a byte of the other index.

use crate::common::{self, fixture, serve, ServeWith};
use batchfs::index::SourceFormat;
use std::time::{Duration, Instant};

/// Batch requests `server` has answered (its `batchfs_requests_total{kind="batch"}`).
fn batch_requests(server: &common::Server) -> u64 {
    let text = server.running.metrics().render();
    let line = text.lines().find_map(|l| l.strip_prefix("batchfs_requests_total{kind=\"batch\"} "));
    line.map_or(0, |n| n.parse().unwrap())
}

#[test]
fn a_replica_indexed_again_is_passed_over_while_the_other_is_down_and_fails_reads_once_both_are() {
    let rt = common::runtime();
    let mut fx = fixture(SourceFormat::Tfrecord, 64, 4_000);
    let mut replica_fx = fixture(SourceFormat::Tfrecord, 64, 4_000);
    let a = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let b = rt.block_on(serve(&[("d", &replica_fx.path)], ServeWith::default()));
    // A long timeout: a read that waited it out would show.
    let options = format!("batch_size=4,seed=5,prefetch=0,timeout=60s,servers={}", b.base);
    let (_dir, mounted) = common::mount(&a, "d", &options);
    let m = common::manifest_of(&rt, &a, "d", 0, "batch_size=4&seed=5");
    assert_eq!(m.batches.len(), 16);
    let b = common::index_again(&rt, b, &mut replica_fx);
    let other = common::manifest_of(&rt, &b, "d", 0, "batch_size=4&seed=5");
    assert!(other.batches.iter().zip(&m.batches).any(|(o, m)| o.crc32c != m.crc32c), "the replica serves other bytes");
    let mountpoint = mounted.mountpoint.clone();
    let read = move |batch: u64| {
        let path = mountpoint.join(format!("epoch-0000/batch-{batch:06}.tfrecord"));
        let started = Instant::now();
        (std::fs::read(path), started.elapsed())
    };
    let check = |entry: &batchfs::api::BatchEntry, (bytes, took): (std::io::Result<Vec<u8>>, Duration)| {
        let bytes = bytes.unwrap_or_else(|e| panic!("batch {}: {e}", entry.index));
        assert_eq!((bytes.len() as u64, batchfs::crc::crc32c(&bytes)), (entry.bytes, entry.crc32c), "{entry:?}");
        took
    };
    // Both up: every batch is read from the server of the mount's index, whichever replica was asked first
    // (idle servers share batches by number: the odd ones go to the replica first).
    let asked_before = batch_requests(&b);
    for entry in &m.batches[..8] {
        let took = check(entry, read(entry.index));
        assert!(took < Duration::from_secs(10), "batch {}: {took:?}", entry.index);
    }
    assert!(batch_requests(&b) > asked_before, "the replica was asked, and refused at its head");
    let servers = common::mount_stats(&mounted.mountpoint)["servers"].clone();
    assert_eq!((&servers[0]["other_index"], &servers[1]["other_index"]), (&false.into(), &true.into()), "{servers}");
    // The mount's server down for a while: the read waits for it (the replica is no fallback), and is
    // served once it is back, well within `timeout`.
    let addr = a.running.local_addr();
    rt.block_on(a.running.shutdown());
    let waiting = std::thread::spawn({
        let read = read.clone();
        let batch = m.batches[8].index;
        move || read(batch)
    });
    std::thread::sleep(Duration::from_secs(2));
    let a = rt.block_on(common::serve_on(addr, &[("d", &fx.path)]));
    let took = check(&m.batches[8], waiting.join().unwrap());
    assert!(took >= Duration::from_millis(1500) && took < Duration::from_secs(30), "waited for the server: {took:?}");
    // Both of another index: EIO at once.
    let a = common::index_again(&rt, a, &mut fx);
    for entry in &m.batches[9..12] {
        let (got, took) = read(entry.index);
        let err = got.map(|b| b.len()).expect_err("no byte of another index is read");
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "batch {}: {err}", entry.index);
        assert!(took < Duration::from_secs(15), "batch {}: failed after {took:?}, not at once", entry.index);
    }
    drop(mounted);
    rt.block_on(a.running.shutdown());
    rt.block_on(b.running.shutdown());
}
