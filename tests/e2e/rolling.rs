//! `rolling/`: one epoch's names, each open serving the next epoch of that file.

use crate::common::{self, fixture, serve, ServeWith};
use batchfs::index::SourceFormat;

/// Through the kernel: each open of a `rolling/` name reads the next epoch's file, from `first_epoch`,
/// in both layouts and both read paths (the page cache, kept or not, never serves an earlier epoch's
/// pages: each epoch's file is its own inode); `stat` shows the file the next open gets, or, to a
/// process that has the name open, that file, and `fstat` of an open handle its own. In the indexed
/// layout every epoch of a name has the same size, each record at its slot of the server's slot table,
/// and the twin is one file for every epoch: read right after it is opened, `stat` by name gives it the
/// size it has (DALI reads a twin by the size `stat` gives).
#[test]
fn each_open_of_a_rolling_name_reads_the_next_epoch() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 48, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let q = "batch_size=8&seed=4";
    let table = common::slot_table(&rt, &server, q, 3, 10);
    for layout in ["indexed", "packed"] {
        for (passthrough, cache) in [(true, "drop"), (false, "keep")] {
            let options = format!(
                "batch_size=8,seed=4,first_epoch=3,epochs=10,rolling={layout},passthrough={passthrough},\
                 page_cache={cache}"
            );
            let (_dir, mounted) = common::mount(&server, "d", &options);
            let path = mounted.mountpoint.join("rolling/batch-000002.tfrecord");
            let file_of = |epoch| {
                let packed = common::batch_body(&rt, &server, epoch, 2, &format!("{q}&format=tfrecord"));
                if layout == "indexed" {
                    common::placed(&packed, 2, &table)
                } else {
                    packed
                }
            };
            for epoch in 3..6 {
                let want = file_of(epoch);
                // The file the last round opened is released a moment after its close (the kernel says so
                // asynchronously); from then on the name shows the file the next open gets.
                let size = || std::fs::metadata(&path).unwrap().len();
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while size() != want.len() as u64 && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                assert_eq!(size(), want.len() as u64, "stat: the next open's file");
                let file = std::fs::File::open(&path).unwrap();
                assert_eq!(size(), want.len() as u64, "stat by the process that has it open: its file");
                assert_eq!(file.metadata().unwrap().len(), want.len() as u64, "fstat: its own file");
                let got = std::io::Read::bytes(&file).collect::<Result<Vec<u8>, _>>().unwrap();
                assert!(got == want, "{layout} passthrough={passthrough}: epoch {epoch}");
                assert!(common::map_file(&file) == want, "mmap sees the same bytes");
                if layout == "indexed" {
                    assert_eq!(want.len(), file_of(3).len(), "one size for every epoch");
                }
            }
            // The twin: in the packed layout the epoch's; in the indexed one, the same for every epoch,
            // its size by name that of the file open.
            let twin_path = mounted.mountpoint.join("rolling/batch-000002.tfrecord.idx");
            let twin_file = std::fs::File::open(&twin_path).unwrap();
            let twin = std::io::Read::bytes(&twin_file).collect::<Result<Vec<u8>, _>>().unwrap();
            if layout == "indexed" {
                assert_eq!(std::fs::metadata(&twin_path).unwrap().len(), twin_file.metadata().unwrap().len());
                let layout = batchfs::rolling::FileLayout::new(2, &table.batches[2]);
                assert_eq!(twin, layout.dali_index());
                assert_eq!(std::fs::read(&twin_path).unwrap(), twin, "the same every epoch");
            } else {
                assert_eq!(twin, common::batch_body(&rt, &server, 3, 2, &format!("{q}&format=tfrecord.idx")));
            }
            // Another name starts at first_epoch; the epoch directories are untouched.
            let other = std::fs::read(mounted.mountpoint.join("rolling/batch-000000.tfrecord")).unwrap();
            let packed = common::batch_body(&rt, &server, 3, 0, &format!("{q}&format=tfrecord"));
            assert!(other == if layout == "indexed" { common::placed(&packed, 0, &table) } else { packed });
            let fixed = mounted.mountpoint.join("epoch-0003/batch-000002.tfrecord");
            assert_eq!(std::fs::read(&fixed).unwrap(), std::fs::read(&fixed).unwrap());
            let stats = common::mount_stats(&mounted.mountpoint);
            assert_eq!((stats["checksum_errors"].as_u64(), stats["errors"].as_u64()), (Some(0), Some(0)), "{stats}");
            drop(mounted);
        }
    }
    rt.block_on(server.running.shutdown());
}

/// An open of a `rolling/` name that fails (here: the server is down for longer than `timeout`) gets no
/// file, so it does not move the name on: the next open gets the epoch the failed one would have had.
#[test]
fn a_failed_open_does_not_skip_an_epoch() {
    a_failed_open_or_read_does_not_skip_an_epoch("");
}

/// The same where the open comes before the bytes (no passthrough): the open gets its file and moves the
/// name on, and its reads fail; the name goes back at its close. It skipped the epoch.
#[test]
fn a_failed_read_without_passthrough_does_not_skip_an_epoch() {
    a_failed_open_or_read_does_not_skip_an_epoch(",passthrough=false");
}

fn a_failed_open_or_read_does_not_skip_an_epoch(more: &str) {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 48, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let addr = server.running.local_addr();
    let q = "batch_size=8&seed=4&format=tfrecord";
    let want = common::batch_body(&rt, &server, 3, 2, q);
    let (_dir, mounted) = common::mount(
        &server,
        "d",
        &format!("batch_size=8,seed=4,first_epoch=3,rolling=packed,prefetch=0,timeout=2s{more}"),
    );
    let rolling = mounted.mountpoint.join("rolling");
    // Another name first: epoch 3's manifest is then at hand without the server.
    std::fs::read(rolling.join("batch-000000.tfrecord")).unwrap();
    rt.block_on(server.running.shutdown());
    let err = std::fs::read(rolling.join("batch-000002.tfrecord")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // Reads the kernel repeats at once (its readahead's, then the page's) fail at once: past them.
    std::thread::sleep(batchfs_mount::fs::FAILED_READS_REPEATED_WITHIN);
    let server = rt.block_on(common::serve_on(addr, &[("d", &fx.path)]));
    let got = std::fs::read(rolling.join("batch-000002.tfrecord")).unwrap();
    assert!(got == want, "the failed open's epoch (3) is served, not skipped");
    let next = common::batch_body(&rt, &server, 4, 2, q);
    assert!(std::fs::read(rolling.join("batch-000002.tfrecord")).unwrap() == next, "then epoch 4");
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

/// `rolling/` first used after the dataset was indexed again with other files under the mount (the server
/// restarted over new shards), the mount having listed epoch 0 before: the slot table is the new index's,
/// so the indexed layout's twin (made of the table alone) and its file fail with `EIO` at once, never
/// offsets of the new index's records for the batches the mount lists.
#[test]
fn rolling_first_used_after_the_dataset_was_indexed_again_fails_at_once_never_mixing() {
    let rt = common::runtime();
    let mut fx = fixture(SourceFormat::Tfrecord, 80, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let m = common::manifest_of(&rt, &server, "d", 0, "batch_size=8");
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=8,prefetch=0,timeout=20s,rolling=indexed");
    let batch = std::fs::read(mounted.mountpoint.join("epoch-0000/batch-000000.tfrecord")).unwrap();
    assert_eq!(batchfs::crc::crc32c(&batch), m.batches[0].crc32c);
    let server = common::index_again(&rt, server, &mut fx);
    let rolling = mounted.mountpoint.join("rolling");
    let started = std::time::Instant::now();
    for name in ["batch-000001.tfrecord.idx", "batch-000001.tfrecord"] {
        let err = std::fs::read(rolling.join(name)).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{name}: {err}");
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "at once, not after timeout");
    drop(mounted);
    rt.block_on(server.running.shutdown());
}
