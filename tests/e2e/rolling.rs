//! `rolling/`: one epoch's names, each open serving the next epoch of that file.

use crate::common::{self, fixture, serve, ServeWith};
use batchfs::index::SourceFormat;

/// Through the kernel: each open of a `rolling/` name reads the next epoch's file, from `first_epoch`,
/// in both layouts and both read paths (the page cache, kept or not, never serves an earlier epoch's
/// pages: each epoch's file is its own inode); `stat` shows the file the next open gets, `fstat` of an
/// open handle its own; every epoch of one name has the same size in the slots layout.
#[test]
fn each_open_of_a_rolling_name_reads_the_next_epoch() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 48, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let q = "batch_size=8&seed=4";
    for (layout, format) in [("slots", "tfrecord.slots"), ("packed", "tfrecord")] {
        for (passthrough, cache) in [(true, "drop"), (false, "keep")] {
            let options = format!(
                "batch_size=8,seed=4,first_epoch=3,rolling={layout},passthrough={passthrough},page_cache={cache}"
            );
            let (_dir, mounted) = common::mount(&server, "d", &options);
            let path = mounted.mountpoint.join("rolling/batch-000002.tfrecord");
            for epoch in 3..6 {
                let want = common::batch_body(&rt, &server, epoch, 2, &format!("{q}&format={format}"));
                assert_eq!(std::fs::metadata(&path).unwrap().len(), want.len() as u64, "stat: the next open's file");
                let file = std::fs::File::open(&path).unwrap();
                assert_eq!(
                    std::fs::metadata(&path).unwrap().len(),
                    common::batch_body(&rt, &server, epoch + 1, 2, &format!("{q}&format={format}")).len() as u64
                );
                assert_eq!(file.metadata().unwrap().len(), want.len() as u64, "fstat: its own file");
                let got = std::io::Read::bytes(&file).collect::<Result<Vec<u8>, _>>().unwrap();
                assert!(got == want, "{layout} passthrough={passthrough}: epoch {epoch}");
            }
            // The twin: opened once, as DALI does at build, it is the first epoch's; in the slots layout
            // it holds for every epoch.
            let twin = std::fs::read(mounted.mountpoint.join("rolling/batch-000002.tfrecord.idx")).unwrap();
            let idx = if layout == "slots" { "tfrecord.slots.idx" } else { "tfrecord.idx" };
            assert_eq!(twin, common::batch_body(&rt, &server, 3, 2, &format!("{q}&format={idx}")));
            if layout == "slots" {
                assert_eq!(
                    twin,
                    common::batch_body(&rt, &server, 9, 2, &format!("{q}&format={idx}")),
                    "the same every epoch"
                );
            }
            // Another name starts at first_epoch; the epoch directories are untouched.
            let other = std::fs::read(mounted.mountpoint.join("rolling/batch-000000.tfrecord")).unwrap();
            assert_eq!(other, common::batch_body(&rt, &server, 3, 0, &format!("{q}&format={format}")));
            let fixed = mounted.mountpoint.join("epoch-0003/batch-000002.tfrecord");
            assert_eq!(std::fs::read(&fixed).unwrap(), std::fs::read(&fixed).unwrap());
            let stats = common::mount_stats(&mounted.mountpoint);
            assert_eq!((stats["checksum_errors"].as_u64(), stats["errors"].as_u64()), (Some(0), Some(0)), "{stats}");
            drop(mounted);
        }
    }
    rt.block_on(server.running.shutdown());
}
