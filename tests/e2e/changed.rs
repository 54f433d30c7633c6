//! A dataset changed under a running server: a shard truncated or rewritten in place while mounted,
//! for each way the server reads shards. The server stays up, fails only the batches that read a changed
//! shard (`409`, and `EIO` at the mount at once), says so (`/healthz`, metrics, the log), and no reader
//! ever gets a wrong byte.

use crate::common::{self, fixture, serve, ServeWith};
use batchfs::index::SourceFormat;
use batchfs::plan::{EpochPlan, PlanOptions};
use batchfs_server::config::ServerLimits;
use batchfs_server::storage::{IoMode, Resident};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// The fixture's 200 samples in 4 shards of 50: the shard of sample `i`.
fn shard_of(i: u32) -> u32 {
    i / 50
}

/// Reads every batch file of `epoch` through the mount: the batches that read a shard of `changed` must
/// fail with `EIO`, well before the mount's `timeout` (the server refused them); the others must be read
/// whole and equal the server's manifest.
fn read_epoch(rt: &tokio::runtime::Runtime, server: &common::Server, mnt: &std::path::Path, e: u64, changed: &[u32]) {
    let options = PlanOptions { batch_size: 20, seed: 3, ..Default::default() };
    let plan = EpochPlan::new(200, e, options).unwrap();
    let m = common::manifest_of(rt, server, "d", e, "batch_size=20&seed=3");
    for b in &m.batches {
        let path = mnt.join(format!("epoch-{e:04}/batch-{:06}.tfrecord", b.index));
        let touches = plan.batch(b.index).unwrap().iter().any(|&i| changed.contains(&shard_of(i)));
        let started = Instant::now();
        match std::fs::read(&path) {
            Ok(bytes) => {
                assert!(!touches, "{path:?} read a changed shard and was served");
                assert_eq!((bytes.len() as u64, batchfs::crc::crc32c(&bytes)), (b.bytes, b.crc32c), "{path:?}");
            }
            Err(e) => {
                assert!(touches, "{path:?} reads no changed shard, yet failed: {e}");
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{path:?}: {e}");
                assert!(started.elapsed() < Duration::from_secs(10), "{path:?}: refused, not timed out");
            }
        }
    }
}

#[test]
fn a_shard_truncated_or_rewritten_under_the_server_fails_only_its_batches() {
    let rt = common::runtime();
    for io in [IoMode::Mmap, IoMode::Pread, IoMode::Direct] {
        let fx = fixture(SourceFormat::Tfrecord, 200, 6_000);
        let limits = ServerLimits { io, resident: Resident::Bytes(0), ..ServerLimits::default() };
        let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith { limits: Some(limits), ..ServeWith::default() }));
        let (_dir, mounted) = common::mount(&server, "d", "batch_size=20,seed=3,prefetch=0,timeout=30s,epochs=4");
        read_epoch(&rt, &server, &mounted.mountpoint, 0, &[]);
        let shard = |n: u32| fx.path.join(format!("train-{n:05}-of-00004.tfrecord"));
        // Truncated: the batches that read shard 1 fail, the others are read whole, the server stays up.
        std::fs::OpenOptions::new().write(true).open(shard(1)).unwrap().set_len(1000).unwrap();
        read_epoch(&rt, &server, &mounted.mountpoint, 1, &[1]);
        let get = |path: &str| {
            rt.block_on(async {
                let r = common::h2c().get(format!("{}{path}", server.base)).send().await.unwrap();
                (r.status(), r.text().await.unwrap())
            })
        };
        let (status, health) = get("/healthz");
        assert!(status.is_success(), "{io:?}: the server is up: {health}");
        assert!(health.contains("d changed") && health.contains("train-00001-of-00004.tfrecord"), "{io:?}: {health}");
        let (_, metrics) = get("/metrics");
        assert!(metrics.contains("batchfs_dataset_changed{dataset=\"d\"} 1"), "{io:?}: {metrics}");
        // Rewritten in place, its size kept: refused as soon as the server looks (within a second), never
        // served with its new bytes.
        std::fs::OpenOptions::new().write(true).open(shard(2)).unwrap().write_all_at(&[0xAB; 4096], 100).unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        read_epoch(&rt, &server, &mounted.mountpoint, 2, &[1, 2]);
        drop(mounted);
        rt.block_on(server.running.shutdown());
    }
}
