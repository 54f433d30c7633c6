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
