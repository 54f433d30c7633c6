//! FUSE over io_uring (`fuse_uring=on`, Linux 6.14+): through a real mount whose requests the kernel
//! hands to the daemon's rings, `raw/` reads every file byte for byte, the epoch folders' batch files
//! (opened by passthrough, whose backing ids travel in the ring's replies) match a mount served over
//! `/dev/fuse`, ImageFolder over `shuffled/` gets every sample once an epoch, and readers waiting out a
//! server outage leave the stats file answered (`mount.rs`'s test, over rings). A kernel that does not
//! offer rings (`enable_uring` off) leaves the same mount on `/dev/fuse`, reading the same bytes.

use crate::common::{self, fixture, serve, ServeWith};
use batchfs::index::SourceFormat;
use std::path::Path;

const ENABLE: &str = "/sys/module/fuse/parameters/enable_uring";

/// Sets the fuse module's `enable_uring` and puts back what it was on drop (a panic included). The
/// setting only lets a mount that asks for rings have them; other mounts are unaffected.
struct EnableUring {
    before: String,
}

impl EnableUring {
    fn set(on: bool) -> Option<EnableUring> {
        let ci = std::env::var_os("CI").is_some();
        let Ok(before) = std::fs::read_to_string(ENABLE) else {
            assert!(!ci, "CI must offer FUSE over io_uring (Linux 6.14+ with CONFIG_FUSE_IO_URING): no {ENABLE}");
            eprintln!("skipping: this kernel has no FUSE over io_uring ({ENABLE})");
            return None;
        };
        if let Err(e) = std::fs::write(ENABLE, if on { "Y" } else { "N" }) {
            assert!(!ci, "CI must let root set {ENABLE}: {e}");
            eprintln!("skipping: cannot set {ENABLE}: {e}");
            return None;
        }
        Some(EnableUring { before: before.trim().to_owned() })
    }
}

impl Drop for EnableUring {
    fn drop(&mut self) {
        let _ = std::fs::write(ENABLE, &self.before);
    }
}

/// Every batch file of an epoch folder, by name.
fn epoch_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().into_string().unwrap(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_mount_over_fuse_rings_reads_every_byte_and_one_without_them_falls_back_to_dev_fuse() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 600, 8_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let want_raw = crate::raw::tree(&fx.path);
    let want_samples = crate::shuffled::tree(&fx.path);
    let (_plain_dir, plain) = common::mount(&server, "d", "batch_size=16");
    let want_epoch = epoch_files(&plain.mountpoint.join("epoch-0000"));
    assert!(!want_epoch.is_empty());

    for rings in [true, false] {
        let Some(_set) = EnableUring::set(rings) else { return };
        let (_dir, mounted) = common::mount(&server, "d", "batch_size=16,fuse_uring=on,supervise=false");
        let at = &mounted.mountpoint;
        assert!(crate::raw::tree(&at.join("raw")) == want_raw, "raw/ differs (rings {rings})");
        assert!(epoch_files(&at.join("epoch-0000")) == want_epoch, "epoch-0000 differs (rings {rings})");
        if let Some(got) = crate::shuffled::imagefolder(&at.join("shuffled"), 1) {
            let (samples, _) = crate::shuffled::epoch_of(got["records"].as_array().unwrap(), 0);
            assert_eq!(samples, want_samples, "shuffled/: every sample once (rings {rings})");
        }
        let stats = common::mount_stats(at);
        assert_eq!(stats["errors"], 0, "{stats}");
        let ring_opens = stats["ring_opens"].as_u64().unwrap();
        match rings {
            true => assert!(ring_opens >= 600, "the opens came over the rings: {stats}"),
            false => assert_eq!(ring_opens, 0, "no rings where the kernel offers none: {stats}"),
        }
        drop(mounted);
        if rings {
            // A ring's threads keep one of them free while the others' reads wait out an outage.
            crate::mount::outage_leaves_the_stats_file_and_listings_answered(",fuse_uring=on,supervise=false");
        }
    }
    drop(plain);
    rt.block_on(server.running.shutdown());
}
