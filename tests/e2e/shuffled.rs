//! `shuffled/` through a real mount of a real server: torchvision's `ImageFolder` with a `DataLoader`
//! (`shuffle=True`, four worker processes), default settings, over two epochs of a class-folder tree of
//! the heavy-tailed generator. Every sample once per epoch, under its own class, in a new order each
//! epoch; two mounts of shares 0/2 and 1/2 read every sample once between them.

use crate::common::{self, fixture, serve, ServeWith};
use batchfs::index::SourceFormat;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// `(class, crc32c)` of every file of the tree, as a sorted multiset per class.
pub(crate) fn tree(root: &Path) -> BTreeMap<String, Vec<u64>> {
    let mut out: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for class in std::fs::read_dir(root).unwrap() {
        let class = class.unwrap();
        if !class.file_type().unwrap().is_dir() {
            continue;
        }
        for file in std::fs::read_dir(class.path()).unwrap() {
            let data = std::fs::read(file.unwrap().path()).unwrap();
            let name = class.file_name().to_string_lossy().into_owned();
            out.entry(name).or_default().push(u64::from(batchfs::crc::crc32c(&data)));
        }
    }
    out.values_mut().for_each(|v| v.sort_unstable());
    out
}

/// Runs the ImageFolder loader over `dir` for `epochs`; `None` where torchvision is missing (outside CI).
pub(crate) fn imagefolder(dir: &Path, epochs: u32) -> Option<Value> {
    let python = "/usr/bin/python3";
    let probe = Command::new(python).args(["-c", "import torchvision"]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        assert!(std::env::var_os("CI").is_none(), "CI must install torchvision for {python} (see .ci/run)");
        eprintln!("skipping the ImageFolder test: torchvision does not import in {python}");
        return None;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/loaders.py");
    let epochs = epochs.to_string();
    let args = ["imagefolder", dir.to_str().unwrap(), "--records", "--epochs", &epochs];
    let out = Command::new(python).arg(script).args(args).output().unwrap();
    assert!(out.status.success(), "loaders.py {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Some(serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap())
}

/// The records of one epoch: `(class, crc32c)` per class, sorted, and the order they came in.
pub(crate) fn epoch_of(records: &[Value], epoch: u64) -> (BTreeMap<String, Vec<u64>>, Vec<u64>) {
    let mut per: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut order = Vec::new();
    for r in records.iter().filter(|r| r[3] == epoch) {
        per.entry(r[0].as_str().unwrap().to_owned()).or_default().push(r[2].as_u64().unwrap());
        order.push(r[2].as_u64().unwrap());
    }
    per.values_mut().for_each(|v| v.sort_unstable());
    (per, order)
}

#[test]
fn imagefolder_over_shuffled_reads_every_sample_once_an_epoch_under_its_class() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 600, 8_000);
    let want = tree(&fx.path);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "");
    let Some(got) = imagefolder(&mounted.mountpoint.join("shuffled"), 2) else { return };
    let records = got["records"].as_array().unwrap();
    assert_eq!(records.len(), 1200, "two epochs of 600");
    let (first, order0) = epoch_of(records, 0);
    let (second, order1) = epoch_of(records, 1);
    assert_eq!(first, want, "epoch 0: every sample once, under its class");
    assert_eq!(second, want, "epoch 1: every sample once, under its class");
    assert_ne!(order0, order1, "a new order each epoch");
    let stats = common::mount_stats(&mounted.mountpoint);
    assert_eq!(stats["errors"], 0, "{stats}");
    rt.block_on(server.running.shutdown());
}

#[test]
fn two_shares_of_shuffled_read_every_sample_once_between_them() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 301, 4_000);
    let want = tree(&fx.path);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let mut together: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for rank in 0..2 {
        let (_dir, mounted) = common::mount(&server, "d", &format!("share={rank}/2"));
        let Some(got) = imagefolder(&mounted.mountpoint.join("shuffled"), 1) else { return };
        let (per, _) = epoch_of(got["records"].as_array().unwrap(), 0);
        for (class, crcs) in per {
            together.entry(class).or_default().extend(crcs);
        }
    }
    together.values_mut().for_each(|v| v.sort_unstable());
    assert_eq!(together, want);
    rt.block_on(server.running.shutdown());
}

/// A sample whose reads all failed (the server down past `timeout`) goes back at its close: a loader that
/// skips what it cannot read, then reads on once the server is back, still gets every sample of the class
/// once in the epoch. The sample was the failed file's from its open: lost from the epoch, and a sample of
/// the next read in its place.
#[test]
fn a_sample_no_read_got_is_handed_out_again() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 300, 4_000);
    let want = tree(&fx.path);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let addr = server.running.local_addr();
    // Small windows: a class's next few samples are fetched ahead, not the whole class.
    let (_dir, mounted) = common::mount(&server, "d", "timeout=2s,prefetch_bytes=64K");
    let (class, crcs) = want.iter().next().unwrap();
    let dir = mounted.mountpoint.join("shuffled").join(class);
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    let mut got = Vec::new();
    let mut next = 0;
    let mut read_next = || {
        next += 1;
        std::fs::read(&names[(next - 1) % names.len()]).map(|b| u64::from(batchfs::crc::crc32c(&b)))
    };
    for _ in 0..10 {
        got.push(read_next().unwrap());
    }
    rt.block_on(server.running.shutdown());
    let mut failed = 0;
    for _ in 0..6 {
        match read_next() {
            Ok(crc) => got.push(crc),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
                failed += 1;
            }
        }
    }
    assert!(failed > 0, "the server is down: a sample past the window cannot be read");
    std::thread::sleep(batchfs_mount::fs::FAILED_READS_REPEATED_WITHIN);
    let server = rt.block_on(common::serve_on(addr, &[("d", &fx.path)]));
    while got.len() < crcs.len() {
        got.push(read_next().unwrap());
    }
    got.sort_unstable();
    assert_eq!(&got, crcs, "every sample of the class once in the epoch, the {failed} that failed among them");
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

/// `shuffled/` first used after the dataset was indexed again with other files under the mount (the
/// server restarted over a new tree), its class folders listed before through `raw/` (the lists the two
/// share): the sample table is the new index's, so a class folder's listing and a sample's read fail with
/// `EIO` at once, never pairing the names listed before with the new index's samples.
#[test]
fn shuffled_first_used_after_the_dataset_was_indexed_again_fails_at_once_never_mixing() {
    let rt = common::runtime();
    let mut fx = fixture(SourceFormat::Files, 60, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "timeout=20s");
    let raw = mounted.mountpoint.join("raw");
    let classes = common::names_in(&raw).unwrap();
    let names: Vec<Vec<String>> = classes.iter().map(|c| common::names_in(&raw.join(c)).unwrap()).collect();
    let server = common::index_again(&rt, server, &mut fx);
    let class = mounted.mountpoint.join("shuffled").join(&classes[0]);
    let started = std::time::Instant::now();
    let err = common::names_in(&class).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "a class folder: {err}");
    let err = std::fs::read(class.join(&names[0][0])).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "a sample: {err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "at once, not after timeout");
    drop(mounted);
    rt.block_on(server.running.shutdown());
}
