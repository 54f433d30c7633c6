//! The real data loaders, with their default settings, reading epochs through a real mount: NVIDIA DALI's
//! TFRecord reader (mmap and not), PyTorch's DataLoader with four worker processes, and WebDataset.
//! Each must deliver every sample of the epoch, in the server's plan order, with its bytes and label.
//! The loaders run as `tests/python/loaders.py`; where one is not installed the test says so and passes,
//! except under CI (`CI` set), whose `.ci/run` installs them all.

use crate::common::{self, fixture, serve, ServeWith};
use batchfs::gen;
use batchfs::index::SourceFormat;
use batchfs::plan::{EpochPlan, PlanOptions};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// Runs `loaders.py` with `python`, or `None` when `module` does not import there (outside CI).
fn run_loader(python: &str, module: &str, args: &[&str]) -> Option<Value> {
    let probe = Command::new(python).args(["-c", &format!("import {module}")]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        assert!(std::env::var_os("CI").is_none(), "CI must install {module} for {python} (see .ci/run)");
        eprintln!("skipping the {module} loader test: {module} does not import in {python}");
        return None;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/loaders.py");
    let out = Command::new(python).arg(script).args(args).output().unwrap();
    assert!(out.status.success(), "loaders.py {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    Some(serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap())
}

/// `[key, label, crc32c of the image]` of samples `order` of the fixture, in that order.
fn records(fx: &common::Fixture, order: impl IntoIterator<Item = u32>) -> Vec<Value> {
    order
        .into_iter()
        .map(|i| {
            let s = gen::sample(&fx.options, i);
            serde_json::json!([s.key, s.label, batchfs::crc::crc32c(&s.data)])
        })
        .collect()
}

/// The records of every sample of `epoch`, in plan order.
fn planned_records(fx: &common::Fixture, epoch: u64, options: PlanOptions) -> Vec<Value> {
    records(fx, EpochPlan::new(fx.options.samples, epoch, options).unwrap().order().iter().copied())
}

/// Two epochs through one mount (the second warmed by the first's window), each against its plan.
#[test]
fn dali_reads_epochs_in_plan_order_with_mmap_and_without() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 300, 6_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let plan = PlanOptions { batch_size: 32, seed: 5, ..Default::default() };
    for passthrough in [true, false] {
        let (_dir, mounted) =
            common::mount(&server, "d", &format!("batch_size=32,seed=5,epochs=2,passthrough={passthrough}"));
        for (epoch, mode) in [(0, None), (1, Some("--no-mmap"))] {
            let dir = mounted.mountpoint.join(format!("epoch-{epoch:04}"));
            let mut args = vec!["dali", dir.to_str().unwrap(), "--records"];
            args.extend(mode);
            let Some(got) = run_loader("python3", "nvidia.dali", &args) else { return };
            assert_eq!(got["samples"], 300);
            let want = planned_records(&fx, epoch, plan);
            assert!(got["records"].as_array().unwrap() == &want, "epoch {epoch} {mode:?} passthrough={passthrough}");
        }
        let stats = common::mount_stats(&mounted.mountpoint);
        assert_eq!(stats["checksum_errors"], 0);
        assert_eq!(stats["errors"], 0, "{stats}");
    }
    rt.block_on(server.running.shutdown());
}

/// DataLoader workers are processes: four of them take the batch files in turn.
#[test]
fn pytorch_dataloader_workers_read_every_batch_file_whole() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 200, 4_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=16,seed=2");
    let dir = mounted.mountpoint.join("epoch-0000");
    // Debian's python3-torch installs for Debian's own interpreter.
    let Some(got) = run_loader("/usr/bin/python3", "torch", &["torch", dir.to_str().unwrap(), "--records"]) else {
        return;
    };
    let manifest = common::manifest_of(&rt, &server, "d", 0, "batch_size=16&seed=2");
    let want: Vec<Value> = manifest
        .batches
        .iter()
        .map(|b| serde_json::json!([format!("batch-{:06}.tfrecord", b.index), b.bytes, b.crc32c]))
        .collect();
    assert_eq!(got["records"].as_array().unwrap(), &want);
    assert_eq!(got["bytes"], manifest.bytes);
    rt.block_on(server.running.shutdown());
}

/// WebDataset over `format=tar` batches: samples grouped from the tar members, in plan order.
#[test]
fn webdataset_reads_tar_batches_in_plan_order() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tar, 120, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=10,seed=9,format=tar");
    let dir = mounted.mountpoint.join("epoch-0000");
    let Some(got) = run_loader("python3", "webdataset", &["wds", dir.to_str().unwrap(), "--records"]) else {
        return;
    };
    let want = planned_records(&fx, 0, PlanOptions { batch_size: 10, seed: 9, ..Default::default() });
    assert_eq!(got["records"].as_array().unwrap(), &want);
    rt.block_on(server.running.shutdown());
}

/// The records of every sample in source order (the shards' own order).
fn source_records(fx: &common::Fixture) -> Vec<Value> {
    records(fx, 0..fx.options.samples)
}

/// An unchanged DALI pipeline over the original shards, `raw/*.tfrecord` with the `.idx` twins the
/// mount shows beside them (DALI's format, made from the server's index), mmap and not.
#[test]
fn dali_reads_the_original_shards_under_raw_with_their_index_twins() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 300, 6_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=32");
    let raw = mounted.mountpoint.join("raw");
    for mode in [None, Some("--no-mmap")] {
        let mut args = vec!["dali", raw.to_str().unwrap(), "--records"];
        args.extend(mode);
        let Some(got) = run_loader("python3", "nvidia.dali", &args) else { return };
        assert!(got["records"].as_array().unwrap() == &source_records(&fx), "{mode:?}");
    }
    let stats = common::mount_stats(&mounted.mountpoint);
    assert_eq!((stats["checksum_errors"].as_u64(), stats["errors"].as_u64()), (Some(0), Some(0)), "{stats}");
    rt.block_on(server.running.shutdown());
}

/// WebDataset over the original tar shards, `raw/*.tar`.
#[test]
fn webdataset_reads_the_original_tars_under_raw() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tar, 120, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=10");
    let raw = mounted.mountpoint.join("raw");
    let Some(got) = run_loader("python3", "webdataset", &["wds", raw.to_str().unwrap(), "--records"]) else {
        return;
    };
    assert!(got["records"].as_array().unwrap() == &source_records(&fx));
    rt.block_on(server.running.shutdown());
}

/// The `lmdb` package opens `raw/` as its environment, read-only: without a lock (`lock=False`), and
/// with one, where LMDB finds the filesystem read-only (EROFS) and goes on without the lock file.
/// Every record equals what the same reader gets from the dataset directory itself.
#[test]
fn the_lmdb_package_reads_raw_data_mdb_read_only() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Lmdb, 200, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=16");
    let raw = mounted.mountpoint.join("raw");
    let Some(want) = run_loader("python3", "lmdb", &["lmdb", fx.path.to_str().unwrap(), "--records"]) else {
        return;
    };
    assert_eq!(want["samples"], 200);
    for lock in [None, Some("--lock")] {
        let mut args = vec!["lmdb", raw.to_str().unwrap(), "--records"];
        args.extend(lock);
        let got = run_loader("python3", "lmdb", &args).unwrap();
        assert!(got["records"] == want["records"], "{lock:?}");
    }
    assert!(!raw.join("lock.mdb").exists(), "no lock file was made");
    rt.block_on(server.running.shutdown());
}

/// `planned_records` of `epochs`, one after another.
fn planned_passes(fx: &common::Fixture, epochs: std::ops::Range<u64>, options: PlanOptions) -> Vec<Value> {
    epochs.flat_map(|e| planned_records(fx, e, options)).collect()
}

/// A DALI pipeline built once over `rolling/` (its `.idx` twins read once, at build) and run for three
/// epochs: each pass over the files is a new epoch of the server's plan, every sample once per epoch,
/// mmap and not. The slots layout keeps every record where the twins say, whatever the epoch.
#[test]
fn a_dali_pipeline_built_once_over_rolling_reads_a_new_epoch_at_each_pass() {
    let rt = common::runtime();
    // Epochs longer than the samples DALI's mmap reader keeps alive (see the test below).
    let fx = fixture(SourceFormat::Tfrecord, 600, 4_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let plan = PlanOptions { batch_size: 32, seed: 5, ..Default::default() };
    let want = planned_passes(&fx, 0..3, plan);
    for mode in [None, Some("--no-mmap")] {
        let (_dir, mounted) = common::mount(&server, "d", "batch_size=32,seed=5,epochs=3,rolling=slots");
        let dir = mounted.mountpoint.join("rolling");
        let mut args = vec!["dali", dir.to_str().unwrap(), "--records", "--epochs", "3"];
        args.extend(mode);
        let Some(got) = run_loader("python3", "nvidia.dali", &args) else { return };
        let got = got["records"].as_array().unwrap();
        assert_eq!(got.len(), 1800, "{mode:?}");
        assert!(got[..600] != got[600..1200], "a new order each epoch");
        assert!(got == &want, "{mode:?}: every pass is the next epoch of the plan");
        let stats = common::mount_stats(&mounted.mountpoint);
        assert_eq!((stats["checksum_errors"].as_u64(), stats["errors"].as_u64()), (Some(0), Some(0)), "{stats}");
    }
    rt.block_on(server.running.shutdown());
}

/// Data-parallel nodes, each with its own mount: DALI `shard_id`/`num_shards` with `stick_to_shard`
/// reads the same files of `rolling/` at every pass, and each node gets its half of every epoch's plan.
/// (A node's pass is longer than the samples DALI's mmap reader keeps alive, about three batches: a file
/// it opens again while samples of its last pass are alive gets the old mapping; see SEMANTICS.md.)
#[test]
fn data_parallel_nodes_each_read_their_shard_of_every_epoch_through_rolling() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 1200, 2_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let plan = PlanOptions { batch_size: 16, seed: 3, ..Default::default() };
    for node in 0..2u64 {
        let (_dir, mounted) = common::mount(&server, "d", "batch_size=16,seed=3,epochs=2,rolling=slots");
        let dir = mounted.mountpoint.join("rolling");
        let shard = format!("{node}/2");
        let args = ["dali", dir.to_str().unwrap(), "--records", "--epochs", "2", "--shard", &shard];
        let Some(got) = run_loader("python3", "nvidia.dali", &args) else { return };
        let half = |e| planned_records(&fx, e, plan)[node as usize * 600..(node as usize + 1) * 600].to_vec();
        let want: Vec<Value> = [half(0), half(1)].concat();
        assert!(got["records"].as_array().unwrap() == &want, "node {node}");
    }
    rt.block_on(server.running.shutdown());
}

/// WebDataset built once over `rolling/` tars, three passes from `first_epoch=2`: epochs 2, 3 and 4.
#[test]
fn webdataset_over_rolling_tars_reads_a_new_epoch_at_each_pass() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tar, 120, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=10,seed=9,format=tar,first_epoch=2,epochs=3");
    let dir = mounted.mountpoint.join("rolling");
    let args = ["wds", dir.to_str().unwrap(), "--records", "--epochs", "3"];
    let Some(got) = run_loader("python3", "webdataset", &args) else { return };
    let want = planned_passes(&fx, 2..5, PlanOptions { batch_size: 10, seed: 9, ..Default::default() });
    assert!(got["records"].as_array().unwrap() == &want);
    rt.block_on(server.running.shutdown());
}
