//! The mount for real: the real server, a real FUSE mount in this process, reads through the kernel.
//! Every mount is a `Mounted` that unmounts on drop, so a failing test leaves nothing mounted.

use crate::common::{self, expected_samples, fixture, serve, ServeWith};
use batchfs::api::{self, Manifest};
use batchfs::index::SourceFormat;
use batchfs::plan::{EpochPlan, PlanOptions};
use batchfs::{crc, tfrecord};
use std::io::{ErrorKind, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::runtime;

fn manifest(rt: &tokio::runtime::Runtime, server: &common::Server, query: &str) -> Manifest {
    common::manifest_of(rt, server, "d", 0, query)
}

/// Reads a file with small reads at odd sizes, as a loader may.
fn read_in_pieces(path: &Path, piece: usize) -> Vec<u8> {
    let mut f = std::fs::File::open(path).unwrap();
    let mut out = Vec::new();
    let mut buf = vec![0u8; piece];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

#[test]
fn reads_through_the_mount_equal_the_server_and_decode_to_the_samples() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Files, 60, 20_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=8,seed=3,epochs=2");
    let root = mounted.mountpoint.clone();
    let mut names: Vec<String> =
        std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, [".batchfs", "epoch-0000", "epoch-0001", "raw", "rolling", "shuffled"]);
    let query = "batch_size=8&seed=3";
    let m = manifest(&rt, &server, query);
    let epoch = root.join("epoch-0000");
    let listed = std::fs::read_dir(&epoch).unwrap().count();
    assert_eq!(listed, 2 * m.batches.len(), "batch files and their .idx twins");
    let expected = expected_samples(&fx);
    let plan = EpochPlan::new(60, 0, PlanOptions { batch_size: 8, seed: 3, ..Default::default() }).unwrap();
    for entry in &m.batches {
        let path = epoch.join(format!("batch-{:06}.tfrecord", entry.index));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), entry.bytes, "stat size from the manifest");
        let via_read = read_in_pieces(&path, 7919);
        assert_eq!(via_read, common::batch_body(&rt, &server, 0, entry.index, query), "batch {}", entry.index);
        // mmap(MAP_PRIVATE) sees the same bytes as read(2).
        let file = std::fs::File::open(&path).unwrap();
        let mut via_pread = vec![0u8; via_read.len()];
        file.read_exact_at(&mut via_pread, 0).unwrap();
        assert_eq!(via_pread, via_read);
        let mapped = common::map_file(&file);
        assert_eq!(&mapped[..], &via_read[..], "mmap read of batch {}", entry.index);
        // Decodes to the planned samples.
        let records: Vec<_> = tfrecord::Scanner::new(&via_read, true).collect::<Result<_, _>>().unwrap();
        let want = plan.batch(entry.index).unwrap();
        assert_eq!(records.len(), want.len());
        for (rec, &i) in records.iter().zip(want) {
            let data = &via_read[rec.data_offset() as usize..(rec.data_offset() + rec.len) as usize];
            let got = batchfs::proto::example_feature(data, "data").unwrap();
            assert_eq!(got, Some(batchfs::proto::FeatureValue::Bytes(vec![&expected[i as usize].parts[0].1[..]])));
        }
        let idx = std::fs::read(epoch.join(format!("batch-{:06}.tfrecord.idx", entry.index))).unwrap();
        let frames: String = records.iter().map(|r| format!("{} {}\n", r.frame_offset, r.frame_len())).collect();
        assert_eq!(String::from_utf8(idx).unwrap(), frames);
    }
    // Epochs beyond those listed resolve by name.
    let far = root.join("epoch-0042").join("batch-000000.tfrecord");
    assert_eq!(crc::crc32c(&std::fs::read(&far).unwrap()), {
        let url = format!("{}{}?{query}", server.base, api::manifest_path("d", 42));
        let m42: Manifest = rt.block_on(async { common::h2c().get(url).send().await.unwrap().json().await.unwrap() });
        m42.batches[0].crc32c
    });
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

#[test]
fn concurrent_and_interleaved_readers_get_prefetch_hits() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 256, 8_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    for passthrough in [true, false] {
        interleaved_readers(&rt, &server, passthrough);
    }
    rt.block_on(server.running.shutdown());
}

/// Waits until the mount at `mountpoint` has had no fetch in flight for three looks in a row (at most 10 s):
/// the prefetches a read started have arrived.
fn settle(mountpoint: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut settled = 0;
    while settled < 3 && Instant::now() < deadline {
        let in_flight = common::mount_stats(mountpoint)["in_flight"].as_u64().unwrap();
        settled = if in_flight == 0 { settled + 1 } else { 0 };
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Two DALI ranks with `shard_id` on one node read contiguous halves of each epoch, side by side. Each
/// rank's window runs on into the next epoch from its own shard's start, so neither waits for its first
/// batches there. It ran on from batch 0 (the phase of a stride-1 stream), and the second rank fetched
/// its next epoch's first two batches on demand.
#[test]
fn range_shards_find_their_next_epochs_first_batches_prefetched() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 256, 8_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=4,prefetch=4,prefetch_bytes=0,epochs=2");
    let m = manifest(&rt, &server, "batch_size=4");
    let half = m.batches.len() / 2;
    let read = |epoch: usize, b: usize| {
        let path = mounted.mountpoint.join(format!("epoch-{epoch:04}/batch-{b:06}.tfrecord"));
        std::fs::read(path).unwrap()
    };
    let n = |k: &str| common::mount_stats(&mounted.mountpoint)[k].as_u64().unwrap();
    // One thread reads for both ranks in turn (the same process: a rank's stream starts at its second
    // read all the same), so the order of reads is the same in every run.
    for b in 0..half {
        for rank in 0..2 {
            let body = read(0, rank * half + b);
            assert_eq!(crc::crc32c(&body), m.batches[rank * half + b].crc32c);
        }
    }
    // The windows that ran on into epoch 1 arrive (its manifest is fetched in the background first).
    settle(&mounted.mountpoint);
    let misses = n("misses");
    let m1 = common::manifest_of(&rt, &server, "d", 1, "batch_size=4");
    for b in 0..half {
        for rank in 0..2 {
            let body = read(1, rank * half + b);
            assert_eq!(crc::crc32c(&body), m1.batches[rank * half + b].crc32c);
        }
    }
    let stats = common::mount_stats(&mounted.mountpoint);
    assert_eq!(stats["misses"].as_u64().unwrap(), misses, "epoch 1 was read without a miss: {stats}");
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

/// DALI's reader, one pipeline per epoch folder, reads on past the epoch's last file into its first ones
/// while it finishes the epoch. Once the mount has seen that, it keeps each epoch's first batches for it
/// (in a cache of a quarter of an epoch) and warms nothing more of the epoch at its end: in later epochs
/// the wrap-around waits for nothing and no batch is fetched twice.
#[test]
fn a_loader_finishing_an_epoch_reads_its_first_batches_again_from_the_cache() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 256, 8_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let m = manifest(&rt, &server, "batch_size=4");
    let largest = m.batches.iter().map(|b| b.bytes).max().unwrap();
    let cache = (m.bytes / 4).max(4 * largest);
    let options = format!("batch_size=4,prefetch=8,prefetch_bytes=0,epochs=3,cache={cache},stale_after=1h");
    let (_dir, mounted) = common::mount(&server, "d", &options);
    let n = |k: &str| common::mount_stats(&mounted.mountpoint)[k].as_u64().unwrap();
    let mut fetched = Vec::new();
    let mut expected = 0;
    for epoch in 0..3u64 {
        let m = common::manifest_of(&rt, &server, "d", epoch, "batch_size=4");
        // Each epoch once, and epoch 0's first four batches again (what DALI may read as it wraps around):
        // the mount had not seen a wrap-around yet.
        expected += m.bytes + if epoch == 0 { m.batches[..4].iter().map(|b| b.bytes).sum() } else { 0 };
        let before = (n("misses"), n("fetched_bytes"));
        // The epoch, then its first three batches again, as DALI reads them finishing its last batch.
        for b in (0..m.batches.len()).chain(0..3) {
            let path = mounted.mountpoint.join(format!("epoch-{epoch:04}/batch-{b:06}.tfrecord"));
            assert_eq!(crc::crc32c(&std::fs::read(path).unwrap()), m.batches[b].crc32c, "epoch {epoch} batch {b}");
        }
        settle(&mounted.mountpoint);
        fetched.push((epoch, n("misses") - before.0, n("fetched_bytes") - before.1, m.bytes));
    }
    // (epoch, misses, bytes fetched while it was read, its bytes)
    for &(epoch, misses, ..) in &fetched[1..] {
        assert_eq!(misses, 0, "epoch {epoch} waited for a batch: {fetched:?}");
    }
    let total: u64 = fetched.iter().map(|f| f.2).sum();
    assert!(total <= expected, "{total} bytes fetched for {expected}: {fetched:?}");
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

/// Eight threads read every 8th batch file whole; each file equals the server's batch. With passthrough
/// no read reaches the daemon; without, every open and read does.
fn interleaved_readers(rt: &tokio::runtime::Runtime, server: &common::Server, passthrough: bool) {
    // One epoch (the job reads one): no window runs on into the next.
    let options = format!("batch_size=4,format=tar,prefetch=8,epochs=1,passthrough={passthrough}");
    let (_dir, mounted) = common::mount(server, "d", &options);
    let m = manifest(rt, server, "batch_size=4&format=tar");
    let epoch = mounted.mountpoint.join("epoch-0000");
    let readers = 8;
    std::thread::scope(|s| {
        for r in 0..readers {
            let (epoch, m) = (&epoch, &m);
            s.spawn(move || {
                for b in (r..m.batches.len()).step_by(readers) {
                    let body = std::fs::read(epoch.join(format!("batch-{b:06}.tar"))).unwrap();
                    assert_eq!(body.len() as u64, m.batches[b].bytes);
                    assert_eq!(crc::crc32c(&body), m.batches[b].crc32c, "batch {b}");
                }
            });
        }
    });
    let stats = common::mount_stats(&mounted.mountpoint);
    let n = |k: &str| stats[k].as_u64().unwrap();
    let lookups = n("reads") + n("passthrough_opens");
    assert_eq!(n("hits") + n("misses"), lookups, "{stats}");
    assert!(n("prefetches") > 0, "{stats}");
    assert!(n("misses") * 4 <= lookups, "interleaved readers should mostly find their batch prefetched: {stats}");
    assert_eq!(stats["checksum_errors"], 0);
    let files = m.batches.len() as u64;
    if passthrough {
        assert_eq!(stats["passthrough"], true, "this kernel offers passthrough: {stats}");
        assert_eq!((n("passthrough_opens"), n("daemon_opens"), n("reads")), (files, 0, 0), "{stats}");
        assert_eq!(n("passthrough_bytes"), m.bytes, "{stats}");
        assert_eq!(n("bytes_served"), m.bytes, "each file served once, whole: {stats}");
    } else {
        assert_eq!(stats["passthrough"], false);
        assert_eq!((n("passthrough_opens"), n("daemon_opens")), (0, files), "{stats}");
        assert_eq!(n("bytes_served"), m.bytes, "{stats}");
    }
    drop(mounted);
}

/// Through the daemon, `page_cache=drop` (the default) drops a file's kernel page cache when its last
/// handle closes: the node's memory does not fill with batch files already read, and a second read
/// reaches the daemon again (with the same bytes). `page_cache=keep` leaves it: a second read never
/// reaches the daemon. A file still mapped keeps its pages until it is unmapped.
#[test]
fn the_page_cache_of_a_closed_file_is_dropped_unless_kept() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 32, 20_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let m = manifest(&rt, &server, "batch_size=8");
    for keep in [false, true] {
        let cache = if keep { "keep" } else { "drop" };
        let (_dir, mounted) =
            common::mount(&server, "d", &format!("batch_size=8,passthrough=false,page_cache={cache}"));
        let path = mounted.mountpoint.join("epoch-0000/batch-000001.tfrecord");
        let n = |k: &str| common::mount_stats(&mounted.mountpoint)[k].as_u64().unwrap();
        let first = std::fs::read(&path).unwrap();
        assert_eq!(crc::crc32c(&first), m.batches[1].crc32c);
        let reads = n("reads");
        assert!(reads > 0);
        if !keep {
            // The drop happens at RELEASE, which the kernel sends after `close` returned.
            assert_eq!(common::wait_for_stat(&mounted.mountpoint, "page_cache_drops", 1), 1);
        }
        // A mapping outlives its handle: the pages stay while it is mapped, so nothing is dropped yet.
        let file = std::fs::File::open(&path).unwrap();
        let map = batchfs::mmap::MappedFile::open_file(&file).unwrap();
        drop(file);
        let mapped = map.bytes().to_vec();
        assert_eq!(mapped, first);
        drop(map);
        if !keep {
            // Opened again before the mapping's RELEASE arrives, the file would still be open, its pages
            // kept, and the second read served by the kernel: wait for the second drop.
            assert_eq!(common::wait_for_stat(&mounted.mountpoint, "page_cache_drops", 2), 2);
        }
        let second = std::fs::read(&path).unwrap();
        assert_eq!(second, first, "the same bytes, read again");
        let drops = n("page_cache_drops");
        if keep {
            assert_eq!(drops, 0);
            assert_eq!(n("reads"), reads, "with page_cache=keep the second read is the kernel's alone");
        } else {
            // Dropped at the first close, and again after the mapping went: the mapping's faults, and
            // then the second read, reached the daemon.
            let drops = common::wait_for_stat(&mounted.mountpoint, "page_cache_drops", 3);
            assert_eq!(drops, 3, "dropped at each of the three last closes");
            assert!(n("reads") >= reads + 2, "the second read must reach the daemon: {} reads", n("reads"));
        }
        drop(mounted);
    }
    rt.block_on(server.running.shutdown());
}

/// Each open of `.batchfs/stats` reads one snapshot, taken at the open, however the reader splits its
/// reads and however the counters move between them: pieces of two snapshots are not one JSON document
/// (a counter that gains a digit shifts every byte after it).
#[test]
fn each_open_of_the_stats_file_reads_one_snapshot() {
    use std::io::Read;
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 16, 20_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=8,prefetch=0");
    let before = common::mount_stats(&mounted.mountpoint);
    assert_eq!(before["bytes_served"], 0);
    let mut stats = std::fs::File::open(mounted.mountpoint.join(".batchfs/stats")).unwrap();
    let mut head = [0u8; 10];
    stats.read_exact(&mut head).unwrap();
    // Between the two reads, a batch read moves the counters from 0 to six-digit values.
    let batch = std::fs::read(mounted.mountpoint.join("epoch-0000/batch-000000.tfrecord")).unwrap();
    assert!(batch.len() > 100_000);
    let mut json = head.to_vec();
    stats.read_to_end(&mut json).unwrap();
    let snapshot: serde_json::Value = serde_json::from_slice(&json).expect("one JSON document");
    assert_eq!(snapshot["bytes_served"], 0, "the snapshot taken at the open");
    assert!(common::mount_stats(&mounted.mountpoint)["bytes_served"].as_u64().unwrap() >= batch.len() as u64);
    drop(stats);
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

/// A mount unmounted from outside, and another made at the same place before the first one's session is
/// dropped (its process ending late): the drop leaves the second mount alone. fuser's check before it
/// unmounts by path read the kernel's "connection gone" the wrong way round, and took the second mount down.
#[test]
fn a_session_unmounted_from_outside_leaves_the_next_mount_at_its_place_alone() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 5_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let url = format!("{}/d", server.base);
    let dir = tempfile::tempdir().unwrap();
    let mount_here = || {
        let plan = batchfs_mount::plan::plan(&url, dir.path(), Default::default()).unwrap();
        batchfs_mount::mount::spawn(&plan).unwrap()
    };
    let first = mount_here();
    let path = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `path` is a valid NUL-terminated string that outlives the call.
    assert_eq!(unsafe { libc::umount2(path.as_ptr(), 0) }, 0, "{}", std::io::Error::last_os_error());
    let second = mount_here();
    // The first session ends (its filesystem is gone) and is dropped.
    first.wait().unwrap();
    assert!(batchfs_mount::plan::is_mountpoint(dir.path()), "the second mount was taken down");
    assert!(std::fs::read(dir.path().join(".batchfs/stats")).is_ok());
    second.unmount().unwrap();
}

#[test]
fn writes_fail_with_erofs_and_unknown_names_with_enoent() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tar, 10, 1000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=4");
    let root = &mounted.mountpoint;
    let file = root.join("epoch-0000/batch-000000.tfrecord");
    let erofs = |r: std::io::Result<()>, what: &str| {
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EROFS), "{what}");
    };
    erofs(std::fs::OpenOptions::new().write(true).open(&file).map(drop), "open for writing");
    erofs(std::fs::OpenOptions::new().append(true).open(&file).map(drop), "open for append");
    erofs(std::fs::write(root.join("epoch-0000/new"), b"x"), "create");
    erofs(std::fs::create_dir(root.join("dir")), "mkdir");
    erofs(std::fs::remove_file(&file), "unlink");
    erofs(std::fs::rename(&file, root.join("epoch-0000/moved")), "rename");
    erofs(std::fs::OpenOptions::new().write(true).truncate(true).open(&file).map(drop), "truncate");
    let read_only = |flags| {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new().read(true).custom_flags(flags).open(&file)
    };
    erofs(read_only(libc::O_TRUNC).map(drop), "O_TRUNC with read-only access");
    // O_APPEND only concerns writes, which a read-only open cannot make: it opens, and reads, as on any
    // read-only mount.
    let mut head = [0; 16];
    assert_eq!(read_only(libc::O_APPEND).unwrap().read(&mut head).unwrap(), head.len(), "O_RDONLY|O_APPEND");
    erofs(std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o777)), "chmod");
    for missing in
        ["epoch-0000/batch-000003.tfrecord", "epoch-0000/batch-000000.tar", "epoch-1", "nothing", ".batchfs/other"]
    {
        let e = std::fs::metadata(root.join(missing)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{missing}");
    }
    assert_eq!(std::fs::read_dir(&file).unwrap_err().raw_os_error(), Some(libc::ENOTDIR));
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

/// Through the daemon, a read of a batch still arriving (behind a 10 MB/s link, a 4 MB batch takes ~0.4 s)
/// is answered once its bytes are verified by the body's first checkpoints, not at the body's end; the
/// whole file is still exactly the server's batch.
#[test]
fn a_read_through_the_daemon_gets_the_first_bytes_before_the_whole_batch_has_arrived() {
    use batchfs_lab::netem::{start, Link};
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 40, 100_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let m = manifest(&rt, &server, "batch_size=40");
    let link = Link {
        one_way: Duration::from_millis(1),
        jitter: Duration::ZERO,
        rate: Some(10e6),
        queue: batchfs_lab::netem::QUEUE,
    };
    let netem = start("127.0.0.1:0".parse().unwrap(), server.running.local_addr(), link).unwrap();
    let url = format!("http://{}/d", netem.addr);
    let (_dir, mounted) = common::mount_url(&url, "batch_size=40,prefetch=0,passthrough=false");
    let path = mounted.mountpoint.join("epoch-0000/batch-000000.tfrecord");
    let file = std::fs::File::open(&path).unwrap();
    let mut first = vec![0u8; 64 << 10];
    file.read_exact_at(&mut first, 0).unwrap();
    let stats = common::mount_stats(&mounted.mountpoint);
    assert_eq!((stats["early_reads"].as_u64(), stats["in_flight"].as_u64()), (Some(1), Some(1)), "{stats}");
    let body = std::fs::read(&path).unwrap();
    assert_eq!((body.len() as u64, crc::crc32c(&body)), (m.batches[0].bytes, m.batches[0].crc32c));
    assert_eq!(&body[..first.len()], &first[..]);
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

#[test]
fn a_server_outage_is_waited_out_then_reported_as_eio() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Lmdb, 40, 4000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let addr = server.running.local_addr();
    let m = manifest(&rt, &server, "batch_size=4");
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=4,prefetch=0,timeout=4s");
    let epoch = mounted.mountpoint.join("epoch-0000");
    let read = |b: usize| std::fs::read(epoch.join(format!("batch-{b:06}.tfrecord")));
    assert_eq!(crc::crc32c(&read(0).unwrap()), m.batches[0].crc32c);

    // The server goes away; a read waits; the server comes back on the same address: the read completes.
    rt.block_on(server.running.shutdown());
    let restart = std::thread::spawn({
        let path = fx.path.clone();
        move || {
            std::thread::sleep(Duration::from_millis(1500));
            let rt = runtime();
            let server = rt.block_on(common::serve_on(addr, &[("d", &path)]));
            (rt, server)
        }
    });
    let started = Instant::now();
    let body = read(1).unwrap();
    assert!(started.elapsed() >= Duration::from_millis(1000), "the read should have waited for the restart");
    assert_eq!(crc::crc32c(&body), m.batches[1].crc32c, "correct bytes after the restart");
    let (rt2, server2) = restart.join().unwrap();
    assert_eq!(crc::crc32c(&read(2).unwrap()), m.batches[2].crc32c);

    // Down for longer than `timeout`: EIO, after about `timeout`.
    rt2.block_on(server2.running.shutdown());
    let started = Instant::now();
    let err = read(3).unwrap_err();
    let waited = started.elapsed();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(waited >= Duration::from_secs(4) && waited < Duration::from_secs(15), "{waited:?}");
    let stats = common::mount_stats(&mounted.mountpoint);
    assert!(stats["retries"].as_u64().unwrap() > 0 && stats["errors"].as_u64().unwrap() >= 1, "{stats}");
    drop(mounted);
}

/// Through the daemon (no passthrough) a read during an outage fails after its `timeout`, not twice it:
/// Linux repeats a failed readahead's `READ` at once, and the repeat is answered with the same error
/// instead of a wait of its own. A read after the server is back gets its bytes.
#[test]
fn a_read_through_the_daemon_fails_after_one_timeout_not_two() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Lmdb, 40, 4000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let addr = server.running.local_addr();
    let m = manifest(&rt, &server, "batch_size=4");
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=4,prefetch=0,timeout=3s,passthrough=off");
    let epoch = mounted.mountpoint.join("epoch-0000");
    let read = |b: usize| std::fs::read(epoch.join(format!("batch-{b:06}.tfrecord")));
    assert_eq!(crc::crc32c(&read(0).unwrap()), m.batches[0].crc32c);
    rt.block_on(server.running.shutdown());
    let started = Instant::now();
    let err = read(1).unwrap_err();
    let waited = started.elapsed();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // One `timeout` (3 s) and some slack; the kernel's repeat waiting out its own made it 6 s.
    assert!(waited >= Duration::from_secs(3) && waited < Duration::from_millis(5500), "EIO after {waited:?}");
    // The server back, the same file reads whole.
    std::thread::sleep(batchfs_mount::fs::FAILED_READS_REPEATED_WITHIN);
    let server = rt.block_on(common::serve_on(addr, &[("d", &fx.path)]));
    assert_eq!(crc::crc32c(&read(1).unwrap()), m.batches[1].crc32c);
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

/// Readers waiting out a server outage, more of them than the mount has FUSE threads, hold none of the
/// threads the rest of the mount answers with: the stats file and the root answer while the reads wait (they
/// waited for the reads' `timeout` before), and every read completes with its bytes when the server is back.
#[test]
fn readers_waiting_out_an_outage_leave_the_stats_file_and_listings_answered() {
    outage_leaves_the_stats_file_and_listings_answered("");
}

/// The outage test's body, with `more` mount options (`uring.rs` runs it over FUSE rings).
pub(crate) fn outage_leaves_the_stats_file_and_listings_answered(more: &str) {
    let rt = runtime();
    let fx = fixture(SourceFormat::Lmdb, 40, 4000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let addr = server.running.local_addr();
    let m = manifest(&rt, &server, "batch_size=4");
    let options = format!("batch_size=4,prefetch=0,timeout=60s,threads=2{more}");
    let (_dir, mounted) = common::mount(&server, "d", &options);
    let epoch = mounted.mountpoint.join("epoch-0000");
    assert_eq!(std::fs::read_dir(&epoch).unwrap().count(), 2 * m.batches.len(), "listed: the manifest is here");
    rt.block_on(server.running.shutdown());
    let readers: Vec<_> = (1..=6)
        .map(|b| {
            let path = epoch.join(format!("batch-{b:06}.tfrecord"));
            std::thread::spawn(move || std::fs::read(path))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    let (tx, rx) = std::sync::mpsc::channel();
    let mountpoint = mounted.mountpoint.clone();
    std::thread::spawn(move || {
        let stats = std::fs::read(mountpoint.join(".batchfs/stats"));
        let listed = std::fs::read_dir(&mountpoint).map(|d| d.count());
        let _ = tx.send((stats, listed));
    });
    let answered = rx.recv_timeout(Duration::from_secs(20));
    let waiting = readers.iter().all(|r| !r.is_finished());
    // The server is back before anything is asserted: a failing check must not leave readers blocked on
    // this process's own mount.
    let server = rt.block_on(common::serve_on(addr, &[("d", &fx.path)]));
    let read: Vec<_> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    let (stats, listed) = answered.expect("the stats file and the root answer while the reads wait");
    let stats: serde_json::Value = serde_json::from_slice(&stats.unwrap()).unwrap();
    assert!(stats["reads"].is_u64(), "{stats}");
    assert!(listed.unwrap() >= 2);
    assert!(waiting, "the reads waited for the server");
    for (b, body) in (1..=6).zip(read) {
        assert_eq!(crc::crc32c(&body.unwrap()), m.batches[b].crc32c, "batch {b}");
    }
    if more.contains("fuse_uring=on") {
        assert!(stats["ring_opens"].as_u64().unwrap() > 0, "the opens came over the rings: {stats}");
    }
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

#[test]
fn raw_shows_the_source_files_prefetched_in_directory_order() {
    let rt = runtime();
    let tree = fixture(SourceFormat::Files, 40, 3000);
    let shards = fixture(SourceFormat::Tar, 12, 3000);
    let server = rt.block_on(serve(&[("d", &tree.path), ("w", &shards.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=8,prefetch=8");
    let raw = mounted.mountpoint.join("raw");
    let mut classes: Vec<String> =
        std::fs::read_dir(&raw).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    classes.sort();
    let mut on_disk: Vec<String> = std::fs::read_dir(&tree.path)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .collect();
    on_disk.sort();
    assert_eq!(classes, on_disk);
    // Every file, in directory order, equals the source file.
    for s in expected_samples(&tree) {
        let path = raw.join(format!("{}.jpg", s.key));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), s.parts[0].1.len() as u64);
        assert_eq!(std::fs::read(&path).unwrap(), s.parts[0].1, "{}", s.key);
    }
    let stats = common::mount_stats(&mounted.mountpoint);
    assert!(stats["prefetches"].as_u64().unwrap() > 20 && stats["hits"].as_u64().unwrap() > 20, "{stats}");
    drop(mounted);
    // A tar dataset's shards appear as they are.
    let (_dir, mounted) = common::mount(&server, "w", "batch_size=4");
    let shard = std::fs::read(mounted.mountpoint.join("raw/shard-000002.tar")).unwrap();
    assert_eq!(shard, std::fs::read(shards.path.join("shard-000002.tar")).unwrap());
    assert!(!mounted.mountpoint.join("raw/.batchfs-index").exists());
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

#[test]
fn batches_are_spread_over_several_servers() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 2000);
    let a = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let b = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&a, "d", &format!("batch_size=4,prefetch=0,servers={}", b.base));
    let m = manifest(&rt, &a, "batch_size=4");
    for entry in &m.batches {
        let body =
            std::fs::read(mounted.mountpoint.join(format!("epoch-0000/batch-{:06}.tfrecord", entry.index))).unwrap();
        assert_eq!(crc::crc32c(&body), entry.crc32c);
    }
    let batches = |s: &common::Server| {
        let text = s.running.metrics().render();
        text.lines()
            .find_map(|l| l.strip_prefix("batchfs_requests_total{kind=\"batch\"} "))
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    let (on_a, on_b) = (batches(&a), batches(&b));
    assert_eq!(on_a + on_b, m.batches.len() as u64);
    assert!(on_a >= 4 && on_b >= 4, "both servers serve batches: {on_a} / {on_b}");
    drop(mounted);
    rt.block_on(a.running.shutdown());
    rt.block_on(b.running.shutdown());
}

/// `mount` refuses a server of `servers=` that does not serve the dataset, or serves other data under its
/// name: before, the mount came up and a third of its reads (those routed there) answered EIO at once.
/// One that does not answer now is kept (reads fail over, and it may come up later).
#[test]
fn mount_refuses_a_replica_without_the_dataset_or_with_other_data() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 2000);
    let other = fixture(SourceFormat::Tfrecord, 80, 2000);
    let a = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let b = rt.block_on(serve(&[("e", &fx.path), ("d", &other.path)], ServeWith::default()));
    let c = rt.block_on(serve(&[("e", &fx.path)], ServeWith::default()));
    let url = format!("{}/d", a.base);
    let refused = |servers: &str| {
        let mut o = batchfs_mount::options::MountOptions::default();
        o.apply_list(&format!("servers={servers}")).unwrap();
        let dir = tempfile::tempdir().unwrap();
        batchfs_mount::plan::plan(&url, dir.path(), o).err().map(|e| format!("{e:#}"))
    };
    let err = refused(&c.base).expect("a replica without the dataset");
    assert!(err.contains(&format!("dataset \"d\" unknown to {}", c.base)), "{err}");
    let err = refused(&b.base).expect("a replica with other data");
    assert!(err.contains("holds other data as dataset \"d\": 80 samples"), "{err}");
    assert_eq!(refused("http://127.0.0.1:9"), None, "a replica down now is kept");
    for s in [a, b, c] {
        rt.block_on(s.running.shutdown());
    }
}

/// Health-aware routing: one of two replicas dies; after its first failure the mount stops sending it
/// batches (reads go on at full speed from the other, never waiting out a timeout per batch); once it is
/// back on its address, a probe after its backoff puts it back in rotation. `batchfs stats` and the
/// mount's Prometheus endpoint (`metrics=ADDR`) show each server's state and counters.
#[test]
fn a_failed_replica_is_routed_around_and_probed_back() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 256, 2000);
    let a = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let b = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let b_addr = b.running.local_addr();
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let options = format!("batch_size=4,prefetch=0,servers={},metrics=127.0.0.1:{metrics_port}", b.base);
    let (_dir, mounted) = common::mount(&a, "d", &options);
    let m = manifest(&rt, &a, "batch_size=4");
    let epoch = mounted.mountpoint.join("epoch-0000");
    let read = |i: u64| {
        let body = std::fs::read(epoch.join(format!("batch-{i:06}.tfrecord"))).unwrap();
        assert_eq!(crc::crc32c(&body), m.batches[i as usize].crc32c, "batch {i}");
    };
    let servers = || common::mount_stats(&mounted.mountpoint)["servers"].as_array().unwrap().clone();
    for i in 0..8 {
        read(i);
    }
    assert!(servers().iter().all(|s| s["up"] == true && s["requests"].as_u64().unwrap() >= 2), "{:?}", servers());

    // B goes away: at most one read pays for finding out; the rest go to A without waiting.
    rt.block_on(b.running.shutdown());
    let started = Instant::now();
    for i in 8..40 {
        read(i);
    }
    assert!(started.elapsed() < Duration::from_secs(10), "reads waited on the dead replica: {:?}", started.elapsed());
    let s = servers();
    assert_eq!((s[0]["up"].as_bool(), s[1]["up"].as_bool()), (Some(true), Some(false)), "{s:?}");
    assert!(s[1]["failures"].as_u64().unwrap() >= 1 && s[1]["taken_out"].as_u64().unwrap() >= 1, "{s:?}");
    let b_requests = s[1]["requests"].as_u64().unwrap();
    assert!(b_requests <= 8 + 4, "requests kept going to the dead replica: {s:?}");

    // B is back: after its backoff a read probes it, and it serves again.
    let b2 = rt.block_on(common::serve_on(b_addr, &[("d", &fx.path)]));
    std::thread::sleep(Duration::from_millis(1500));
    for i in 40..64 {
        read(i);
    }
    let s = servers();
    assert_eq!(s[1]["up"], true, "{s:?}");
    assert!(s[1]["requests"].as_u64().unwrap() > b_requests + 2, "{s:?}");

    let mut conn = std::net::TcpStream::connect(("127.0.0.1", metrics_port)).unwrap();
    std::io::Write::write_all(&mut conn, b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut conn, &mut text).unwrap();
    assert!(text.contains(&format!("batchfs_mount_server_up{{server=\"{}\"}} 1", b.base)), "{text}");
    assert!(text.contains("batchfs_mount_reads_total "), "{text}");
    drop(mounted);
    rt.block_on(a.running.shutdown());
    rt.block_on(b2.running.shutdown());
}

/// `mount` refuses a cache that cannot hold two of the largest batches of the first epochs it serves
/// (from `first_epoch`, three of them), not only of epoch 0: on heavy-tailed sizes a later epoch's
/// largest batch can be well over epoch 0's.
#[test]
fn mount_refuses_a_cache_too_small_for_the_first_epochs_it_serves() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 400, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let largest = |e: u64| {
        let m = common::manifest_of(&rt, &server, "d", e, "batch_size=8&seed=1");
        m.batches.iter().map(|b| b.bytes).max().unwrap()
    };
    // The first epoch from 5 whose largest batch is over the one before it: a cache for two of 5's only.
    let (first, later) = (5, (6..8).find(|&e| largest(e) > largest(5)).expect("a later epoch with a larger batch"));
    let cache = 2 * largest(first);
    let url = format!("{}/d", server.base);
    let mut o = batchfs_mount::options::MountOptions::default();
    o.apply_list(&format!("batch_size=8,seed=1,first_epoch={first},cache={cache}")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let err = batchfs_mount::plan::plan(&url, dir.path(), o).err().expect("refused").to_string();
    assert!(err.contains("cannot hold two batches") && err.contains(&format!("epoch {later}")), "{err}");
    rt.block_on(server.running.shutdown());
}

/// Two mounts started together at one directory: one is made, the other refused as busy (both found the
/// directory free as they planned, a while before mounting, and both mounted, one over the other).
#[test]
fn two_mounts_started_together_at_one_directory_make_one_mount() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 40, 2_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let url = format!("{}/d", server.base);
    let dir = tempfile::tempdir().unwrap();
    let planned = std::sync::Barrier::new(2);
    let results: Vec<_> = std::thread::scope(|scope| {
        let mounts: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    let mut o = batchfs_mount::options::MountOptions::default();
                    o.apply_list("batch_size=8").unwrap();
                    let plan = batchfs_mount::plan::plan(&url, dir.path(), o).unwrap();
                    // Both planned (the directory free for each) before either mounts.
                    planned.wait();
                    batchfs_mount::mount::spawn(&plan)
                })
            })
            .collect();
        mounts.into_iter().map(|m| m.join().unwrap()).collect()
    });
    let point = std::fs::canonicalize(dir.path()).unwrap();
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let stacked = table.lines().filter(|l| l.split(' ').nth(4) == Some(point.to_str().unwrap())).count();
    let (made, refused): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
    assert_eq!((made.len(), stacked), (1, 1), "mounts made, and at the directory");
    let err = refused.into_iter().next().unwrap().err().unwrap().to_string();
    assert!(err.contains("is busy: something is already mounted there"), "{err}");
    drop(made);
    rt.block_on(server.running.shutdown());
}

/// A self-signed certificate for `localhost` and its key, written into `dir`: the server's TLS files, and
/// the certificate's path (a mount's `ca_file`).
fn self_signed(dir: &Path) -> (batchfs_server::TlsFiles, std::path::PathBuf) {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    (batchfs_server::TlsFiles::new(cert_path.clone(), key_path), cert_path)
}

/// Over TLS: a mount of an `https://` server it trusts through `ca_file`, with a token, reads every
/// batch of an epoch with the bytes a cleartext server of the same dataset sends (bodies of many TLS
/// records, the socket read ahead in large pieces). Without the CA, the mount does not start, and says
/// why.
#[test]
fn a_mount_over_tls_reads_the_bytes_of_a_cleartext_server() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 96, 60_000);
    let dir = tempfile::tempdir().unwrap();
    let (tls, cert_path) = self_signed(dir.path());
    let token = dir.path().join("t");
    std::fs::write(&token, "s3cret\n").unwrap();
    let with = ServeWith { tls: Some(tls), token: Some("s3cret".into()), ..ServeWith::default() };
    let server = rt.block_on(serve(&[("d", &fx.path)], with));
    assert!(server.base.starts_with("https://localhost:"), "{}", server.base);
    let plain = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let options = format!("batch_size=16,ca_file={},token_file={}", cert_path.display(), token.display());
    let (_dir, mounted) = common::mount(&server, "d", &options);
    let m = manifest(&rt, &plain, "batch_size=16");
    assert_eq!(m.batches.len(), 6);
    for entry in &m.batches {
        let path = mounted.mountpoint.join(format!("epoch-0000/batch-{:06}.tfrecord", entry.index));
        let got = read_in_pieces(&path, 1 << 20);
        assert_eq!(got, common::batch_body(&rt, &plain, 0, entry.index, "batch_size=16"), "batch {}", entry.index);
        assert_eq!(crc::crc32c(&got), entry.crc32c);
    }
    drop(mounted);
    let mut o = batchfs_mount::options::MountOptions::default();
    o.apply_list(&format!("batch_size=16,token_file={}", token.display())).unwrap();
    let Err(err) = batchfs_mount::plan::plan(&format!("{}/d", server.base), dir.path(), o) else {
        panic!("a mount that does not trust the server's certificate started");
    };
    let message = format!("{err:#}");
    assert!(message.contains("certificate") || message.contains("UnknownIssuer"), "{message}");
    rt.block_on(async {
        server.running.shutdown().await;
        plain.running.shutdown().await;
    });
}

/// A TCP proxy in front of `upstream` whose live connections can all be silenced at once: from then on
/// their bytes are held and their sockets left open, as a path that dropped idle connections (a NAT, a
/// load balancer) leaves them, while connections made afterwards pass. Dropped, it closes them all (its
/// runtime ends its tasks).
struct SilencingProxy {
    addr: std::net::SocketAddr,
    generation: std::sync::Arc<std::sync::atomic::AtomicU64>,
    _rt: tokio::runtime::Runtime,
}

impl SilencingProxy {
    fn start(upstream: std::net::SocketAddr) -> SilencingProxy {
        use std::sync::atomic::{AtomicU64, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = runtime();
        let generation = std::sync::Arc::new(AtomicU64::new(0));
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let now = generation.clone();
        rt.spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else { continue };
                let born = now.load(Ordering::SeqCst);
                let ((client_read, client_write), (server_read, server_write)) =
                    (client.into_split(), server.into_split());
                for (mut from, mut to) in [(client_read, server_write), (server_read, client_write)] {
                    let now = now.clone();
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 64 << 10];
                        while let Ok(n @ 1..) = from.read(&mut buf).await {
                            if now.load(Ordering::SeqCst) != born {
                                // Silenced: hold both sockets open, pass nothing.
                                std::future::pending::<()>().await;
                            }
                            if to.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        SilencingProxy { addr, generation, _rt: rt }
    }

    /// Every connection made so far passes nothing from now on.
    fn silence(&self) {
        self.generation.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Connections whose path went silent while the mount was idle are found dead by the keepalive's PING
/// and replaced, so the next read finds a live connection: no response stalls and nothing is retried.
/// Without the keepalive (`keepalive=0`, the control) the same read waits out a stall on a dead
/// connection and is retried.
#[test]
fn connections_whose_path_went_silent_while_idle_are_replaced_before_a_read_needs_them() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 50_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let m = manifest(&rt, &server, "batch_size=4");
    for (keepalive, retried) in [("0", true), ("1s", false)] {
        let proxy = SilencingProxy::start(server.running.local_addr());
        let url = format!("http://{}/d", proxy.addr);
        let options = format!("batch_size=4,prefetch=0,connections=1,stall_timeout=3s,keepalive={keepalive}");
        let (_dir, mounted) = common::mount_url(&url, &options);
        let read = |b: usize| std::fs::read(mounted.mountpoint.join(format!("epoch-0000/batch-{b:06}.tfrecord")));
        for b in 0..4 {
            assert_eq!(crc::crc32c(&read(b).unwrap()), m.batches[b].crc32c);
        }
        proxy.silence();
        // Idle past the keepalive's PING and its wait.
        std::thread::sleep(Duration::from_secs(5));
        let started = Instant::now();
        for b in 4..8 {
            assert_eq!(crc::crc32c(&read(b).unwrap()), m.batches[b].crc32c, "keepalive={keepalive}");
        }
        let stats = common::mount_stats(&mounted.mountpoint);
        let retries = stats["retries"].as_u64().unwrap();
        assert_eq!(retries > 0, retried, "keepalive={keepalive}: {retries} retries in {:?}", started.elapsed());
        drop(mounted);
    }
    rt.block_on(server.running.shutdown());
}

/// With passthrough on the huge-page tmpfs (root), an evicted batch's memory file is filled again with a
/// later batch, received straight into its pages (over h2c and over TLS, out of rustls's records); a
/// loader's mapping of a batch file, kept after its close, still holds that batch's bytes after the cache
/// has turned over several times (the kernel's lease says the file is shared until it is unmapped), and
/// every batch read equals the server's.
#[test]
fn a_mapped_batch_file_keeps_its_bytes_while_memory_files_are_filled_again() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 384, 40_000);
    let dir = tempfile::tempdir().unwrap();
    let (tls, cert_path) = self_signed(dir.path());
    let plain = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let secure = rt.block_on(serve(&[("d", &fx.path)], ServeWith { tls: Some(tls), ..ServeWith::default() }));
    let options = "batch_size=64,cache=16M,prefetch=2,epochs=6";
    mapped_file_kept_while_files_are_filled_again(&rt, &plain, &plain, options);
    let options = format!("{options},ca_file={}", cert_path.display());
    mapped_file_kept_while_files_are_filled_again(&rt, &secure, &plain, &options);
    rt.block_on(async {
        secure.running.shutdown().await;
        plain.running.shutdown().await;
    });
}

fn mapped_file_kept_while_files_are_filled_again(
    rt: &tokio::runtime::Runtime,
    server: &common::Server,
    plain: &common::Server,
    options: &str,
) {
    let query = "batch_size=64";
    let (_dir, mounted) = common::mount(server, "d", options);
    let manifests: Vec<Manifest> = (0..6).map(|e| common::manifest_of(rt, plain, "d", e, query)).collect();
    let path = |e: usize, b: usize| mounted.mountpoint.join(format!("epoch-{e:04}/batch-{b:06}.tfrecord"));
    let kept = {
        let file = std::fs::File::open(path(0, 1)).unwrap();
        batchfs::mmap::MappedFile::open_file(&file).unwrap()
    };
    assert_eq!(crc::crc32c(kept.bytes()), manifests[0].batches[1].crc32c);
    for (e, m) in manifests.iter().enumerate() {
        for (b, batch) in m.batches.iter().enumerate() {
            let body = std::fs::read(path(e, b)).unwrap();
            assert_eq!((body.len() as u64, crc::crc32c(&body)), (batch.bytes, batch.crc32c), "epoch {e} batch {b}");
        }
    }
    assert_eq!(crc::crc32c(kept.bytes()), manifests[0].batches[1].crc32c, "the mapped batch changed");
    let stats = common::mount_stats(&mounted.mountpoint);
    assert_eq!(stats["passthrough"], true, "this kernel offers passthrough: {stats}");
    if stats["huge_pages"] == true {
        assert!(stats["recycled_bytes"].as_u64().unwrap() > 0, "no memory file filled again: {stats}");
    }
    drop(kept);
    drop(mounted);
}

/// A server restarted over changed files indexes them again: the batches it sends are no longer the ones
/// the mount lists. Each read of one fails at once with why (the server's index is another), and so does
/// an epoch the mount had not listed yet (its manifest planned from the new index). Each read failed its
/// checksum until `timeout`, and the server was taken out of rotation; an epoch not listed before was
/// listed and read from the new files without a word.
#[test]
fn a_dataset_indexed_again_with_other_files_fails_reads_at_once_never_mixing() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 80, 3000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let addr = server.running.local_addr();
    let m = manifest(&rt, &server, "batch_size=8");
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=8,prefetch=0,timeout=20s");
    let epoch = mounted.mountpoint.join("epoch-0000");
    let read = |b: usize| std::fs::read(epoch.join(format!("batch-{b:06}.tfrecord")));
    assert_eq!(crc::crc32c(&read(0).unwrap()), m.batches[0].crc32c);
    rt.block_on(server.running.shutdown());
    // The same shard names, other records.
    let options = batchfs::gen::GenOptions { seed: fx.options.seed + 1, ..fx.options.clone() };
    batchfs::gen::generate(&options, &fx.path).unwrap();
    let server = rt.block_on(common::serve_on(addr, &[("d", &fx.path)]));
    let started = Instant::now();
    let err = read(1).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10), "at once, not after timeout: {:?}", started.elapsed());
    let listed = std::fs::read_dir(mounted.mountpoint.join("epoch-0003"))
        .and_then(|d| d.collect::<std::io::Result<Vec<_>>>().map(|entries| entries.len()));
    let err = listed.unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "an epoch not listed before: {err}");
    let stats = common::mount_stats(&mounted.mountpoint);
    assert_eq!(stats["servers"][0]["up"], true, "the server kept in rotation: {stats}");
    drop(mounted);
    rt.block_on(server.running.shutdown());
}
