//! The real data loaders, with their default settings, reading epochs through a real mount: NVIDIA DALI's
//! TFRecord reader (mmap and not) and its WebDataset reader, PyTorch's DataLoader with four worker
//! processes, WebDataset, tf.data's TFRecordDataset and the `tfrecord` package.
//! Each must deliver every sample of the epoch, in the server's plan order, with its bytes and label.
//! The loaders run as `tests/python/loaders.py`; where one is not installed the test says so and passes,
//! except under CI (`CI` set), whose `.ci/run` installs them all.

use crate::common::{self, fixture, serve, ServeWith};
use batchfs::api::SlotTable;
use batchfs::encode::tar_sample_key;
use batchfs::gen;
use batchfs::index::SourceFormat;
use batchfs::plan::{EpochPlan, PlanOptions};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// Runs `loaders.py` with `python`, or `None` when `module` does not import there (outside CI).
pub(crate) fn run_loader(python: &str, module: &str, args: &[&str]) -> Option<Value> {
    let probe = Command::new(python).args(["-c", &format!("import {module}")]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        assert!(std::env::var_os("CI").is_none(), "CI must install {module} for {python} (see .ci/run)");
        eprintln!("skipping the {module} loader test: {module} does not import in {python}");
        return None;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/loaders.py");
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
pub(crate) fn planned_records(fx: &common::Fixture, epoch: u64, options: PlanOptions) -> Vec<Value> {
    records(fx, EpochPlan::new(fx.options.samples, epoch, options).unwrap().order().iter().copied())
}

/// [`planned_records`] with each key as a tar batch names the sample ([`tar_sample_key`]): what WebDataset
/// gives as `__key__`, and DALI's WebDataset reader as the member's name.
fn planned_tar_records(fx: &common::Fixture, epoch: u64, options: PlanOptions) -> Vec<Value> {
    let plan = EpochPlan::new(fx.options.samples, epoch, options).unwrap();
    let mut records = records(fx, plan.order().iter().copied());
    for (record, &id) in records.iter_mut().zip(plan.order()) {
        record[0] = tar_sample_key(record[0].as_str().unwrap(), id).into();
    }
    records
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
    let want = planned_tar_records(&fx, 0, PlanOptions { batch_size: 10, seed: 9, ..Default::default() });
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

/// `planned_tar_records` of `epochs`, one after another.
fn planned_tar_passes(fx: &common::Fixture, epochs: std::ops::Range<u64>, options: PlanOptions) -> Vec<Value> {
    epochs.flat_map(|e| planned_tar_records(fx, e, options)).collect()
}

/// `rolling/`'s slot table for the fixture over `epochs` epochs from `first_epoch`, computed here from
/// the generated samples' TFRecord frames (the server's must be the same).
fn slot_table(fx: &common::Fixture, options: PlanOptions, first_epoch: u64, epochs: u64) -> SlotTable {
    let frames: Vec<u64> =
        (0..fx.options.samples).map(|i| gen::example_bytes(&gen::sample(&fx.options, i)).len() as u64 + 16).collect();
    batchfs::rolling::slot_table(&frames, options, first_epoch, epochs, 2).unwrap()
}

/// The samples of each batch of `epoch`, in the order `rolling/`'s indexed files hold them (by size rank
/// through each file's fixed permutation).
fn indexed_batches(fx: &common::Fixture, epoch: u64, options: PlanOptions, table: &SlotTable) -> Vec<Vec<Value>> {
    let plan = EpochPlan::new(fx.options.samples, epoch, options).unwrap();
    let frame = |i: u32| gen::example_bytes(&gen::sample(&fx.options, i)).len() as u64 + 16;
    (0..plan.batches())
        .map(|b| {
            let samples = plan.batch(b).unwrap();
            let lens: Vec<u64> = samples.iter().map(|&i| frame(i)).collect();
            let layout = batchfs::rolling::FileLayout::new(b, &table.batches[b as usize]);
            let mut placed: Vec<(usize, u32)> =
                layout.positions(b, &lens).unwrap().into_iter().zip(samples.iter().copied()).collect();
            placed.sort_unstable();
            records(fx, placed.into_iter().map(|(_, i)| i))
        })
        .collect()
}

/// [`indexed_batches`] of `epochs`, one after another, flat.
fn indexed_passes(fx: &common::Fixture, epochs: std::ops::Range<u64>, o: PlanOptions, t: &SlotTable) -> Vec<Value> {
    epochs.flat_map(|e| indexed_batches(fx, e, o, t).concat()).collect()
}

/// A DALI pipeline built once over `rolling/` (its `.idx` twins read once, at build) and run for three
/// epochs, mmap and not, on ImageNet-shaped sizes (the generator's heavy tail) with the mount's defaults:
/// each pass over the files is a new epoch of the server's plan, every sample once per epoch, each batch
/// file holding exactly its planned batch, at the offsets its twin gave when the pipeline was built.
#[test]
fn a_dali_pipeline_built_once_over_rolling_reads_a_new_epoch_at_each_pass() {
    let rt = common::runtime();
    // Epochs longer than the samples DALI's mmap reader keeps alive (see the test below).
    let fx = fixture(SourceFormat::Tfrecord, 1200, 20_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let plan = PlanOptions { batch_size: 64, seed: 5, ..Default::default() };
    // The mount's default span: 100 epochs from 0.
    let table = slot_table(&fx, plan, 0, 100);
    let index_id = common::manifest_of(&rt, &server, "d", 0, "batch_size=64&seed=5").index_id;
    let served = common::slot_table(&rt, &server, "batch_size=64&seed=5", 0, 100);
    assert_eq!(served, SlotTable { index_id, ..table.clone() }, "the server's, of its index");
    let want = indexed_passes(&fx, 0..3, plan, &table);
    for mode in [None, Some("--no-mmap")] {
        let (_dir, mounted) = common::mount(&server, "d", "batch_size=64,seed=5");
        let dir = mounted.mountpoint.join("rolling");
        let mut args = vec!["dali", dir.to_str().unwrap(), "--records", "--epochs", "3"];
        args.extend(mode);
        let Some(got) = run_loader("python3", "nvidia.dali", &args) else { return };
        let got = got["records"].as_array().unwrap();
        assert_eq!(got.len(), 3600, "{mode:?}");
        assert!(got[..1200] != got[1200..2400], "a new order each epoch");
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
    let table = slot_table(&fx, plan, 0, 100);
    for node in 0..2u64 {
        let (_dir, mounted) = common::mount(&server, "d", "batch_size=16,seed=3");
        let dir = mounted.mountpoint.join("rolling");
        let shard = format!("{node}/2");
        let args = ["dali", dir.to_str().unwrap(), "--records", "--epochs", "2", "--shard", &shard];
        let Some(got) = run_loader("python3", "nvidia.dali", &args) else { return };
        let half =
            |e| indexed_batches(&fx, e, plan, &table).concat()[node as usize * 600..(node as usize + 1) * 600].to_vec();
        let want: Vec<Value> = [half(0), half(1)].concat();
        assert!(got["records"].as_array().unwrap() == &want, "node {node}");
    }
    rt.block_on(server.running.shutdown());
}

/// WebDataset built once over `rolling/` tars, three passes from `first_epoch=2`: epochs 2, 3 and 4.
#[test]
fn webdataset_over_rolling_tars_reads_a_new_epoch_at_each_pass() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tar, 600, 10_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=50,seed=9,format=tar,first_epoch=2");
    let dir = mounted.mountpoint.join("rolling");
    let args = ["wds", dir.to_str().unwrap(), "--records", "--epochs", "3"];
    let Some(got) = run_loader("python3", "webdataset", &args) else { return };
    let want = planned_tar_passes(&fx, 2..5, PlanOptions { batch_size: 50, seed: 9, ..Default::default() });
    assert!(got["records"].as_array().unwrap() == &want);
    rt.block_on(server.running.shutdown());
}

/// DALI's WebDataset reader over tar batches: an epoch directory in plan order, mmap and not. Over
/// `rolling/` it opens every tar once, when its pipeline is built, and reads every pass through those
/// handles by the offsets it found then: no layout can give it a new epoch per pass with exact bytes, so
/// it reads `first_epoch` at every pass, exactly (docs/SEMANTICS.md).
#[test]
fn dali_reads_tar_batches_with_its_webdataset_reader() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tar, 600, 10_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let plan = PlanOptions { batch_size: 50, seed: 9, ..Default::default() };
    for mode in [None, Some("--no-mmap")] {
        let (_dir, mounted) = common::mount(&server, "d", "batch_size=50,seed=9,format=tar,first_epoch=2");
        let epoch = mounted.mountpoint.join("epoch-0001");
        let mut args = vec!["dali-wds", epoch.to_str().unwrap(), "--records"];
        args.extend(mode);
        let Some(got) = run_loader("python3", "nvidia.dali", &args) else { return };
        assert!(got["records"].as_array().unwrap() == &planned_tar_records(&fx, 1, plan), "{mode:?}");
        let rolling = mounted.mountpoint.join("rolling");
        let mut args = vec!["dali-wds", rolling.to_str().unwrap(), "--records", "--epochs", "2"];
        args.extend(mode);
        let got = run_loader("python3", "nvidia.dali", &args).unwrap();
        let first = planned_tar_records(&fx, 2, plan);
        assert!(got["records"].as_array().unwrap() == &[first.clone(), first].concat(), "{mode:?}");
        let stats = common::mount_stats(&mounted.mountpoint);
        assert_eq!((stats["checksum_errors"].as_u64(), stats["errors"].as_u64()), (Some(0), Some(0)), "{stats}");
    }
    rt.block_on(server.running.shutdown());
}

/// Which planned batch of which epoch `got` (one batch file's records) is, if any, of those `of(e)` gives.
fn epoch_of_batch(got: &[Value], b: usize, of: impl Fn(u64) -> Vec<Vec<Value>>) -> Option<u64> {
    (0..12).find(|&e| of(e).get(b).is_some_and(|want| want.as_slice() == got))
}

/// One mount, its defaults, and several readers in turn, each in its own process: each gets a layout it
/// can parse. DALI (which reads the twins) the indexed one; tf.data, the `tfrecord` package and PyTorch
/// reading whole files (which never open a twin) the packed one, frame after frame. Every batch file a
/// reader reads is exactly one planned batch of an epoch, in its layout's order, and every sample comes
/// once per pass.
#[test]
fn every_reader_of_one_rolling_directory_gets_a_layout_it_can_parse() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 1200, 20_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let plan = PlanOptions { batch_size: 64, seed: 8, ..Default::default() };
    let table = slot_table(&fx, plan, 0, 100);
    let planned = |e| {
        let p = EpochPlan::new(fx.options.samples, e, plan).unwrap();
        (0..p.batches()).map(|b| records(&fx, p.batch(b).unwrap().iter().copied())).collect::<Vec<_>>()
    };
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=64,seed=8");
    let rolling = mounted.mountpoint.join("rolling");
    let dir = rolling.to_str().unwrap();
    let Some(dali) = run_loader("python3", "nvidia.dali", &["dali", dir, "--records"]) else { return };
    let dali = dali["records"].as_array().unwrap();
    assert_eq!(dali.len(), 1200);
    let batches = indexed_batches(&fx, 0, plan, &table);
    let mut at = 0;
    for (b, batch) in batches.iter().enumerate() {
        let got = &dali[at..at + batch.len()];
        at += batch.len();
        let epoch = epoch_of_batch(got, b, |e| indexed_batches(&fx, e, plan, &table));
        assert!(epoch.is_some(), "DALI: batch file {b} is no epoch's indexed batch");
    }
    for loader in ["tfdata", "tfrecord"] {
        let module = if loader == "tfdata" { "tensorflow" } else { "tfrecord" };
        let Some(got) = run_loader("python3", module, &[loader, dir, "--records"]) else { continue };
        let got = got["records"].as_array().unwrap();
        assert_eq!(got.len(), 1200, "{loader}");
        let mut keys: Vec<&Value> = got.iter().map(|r| &r[0]).collect();
        keys.sort_by_key(|k| k.as_str().unwrap());
        keys.dedup();
        assert_eq!(keys.len(), 1200, "{loader}: every sample once");
        for b in 0..batches.len() {
            let name = format!("batch-{b:06}.tfrecord");
            let file: Vec<Value> = got
                .iter()
                .filter(|r| r[3] == name.as_str())
                .map(|r| Value::from(r.as_array().unwrap()[..3].to_vec()))
                .collect();
            assert!(epoch_of_batch(&file, b, planned).is_some(), "{loader}: {name} is no epoch's planned batch");
        }
    }
    if let Some(got) = run_loader("/usr/bin/python3", "torch", &["torch", dir, "--records"]) {
        let manifests: Vec<_> =
            (0..12).map(|e| common::manifest_of(&rt, &server, "d", e, "batch_size=64&seed=8")).collect();
        for file in got["records"].as_array().unwrap() {
            let b: usize = file[0].as_str().unwrap()[6..12].parse().unwrap();
            let whole = |m: &batchfs::api::Manifest| file[1] == m.batches[b].bytes && file[2] == m.batches[b].crc32c;
            assert!(manifests.iter().any(whole), "PyTorch: {file} is no epoch's batch file");
        }
    }
    let stats = common::mount_stats(&mounted.mountpoint);
    assert_eq!((stats["checksum_errors"].as_u64(), stats["errors"].as_u64()), (Some(0), Some(0)), "{stats}");
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

/// tf.data's `TFRecordDataset` over an epoch directory (the plan's order) and over `raw/` (the
/// original shards in source order).
#[test]
fn tf_data_reads_epoch_directories_and_raw_shards() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 300, 20_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "batch_size=32,seed=6");
    let without_file = |got: &Value| -> Vec<Value> {
        got["records"].as_array().unwrap().iter().map(|r| Value::from(r.as_array().unwrap()[..3].to_vec())).collect()
    };
    let epoch = mounted.mountpoint.join("epoch-0000");
    let Some(got) = run_loader("python3", "tensorflow", &["tfdata", epoch.to_str().unwrap(), "--records"]) else {
        return;
    };
    assert!(
        without_file(&got) == planned_records(&fx, 0, PlanOptions { batch_size: 32, seed: 6, ..Default::default() })
    );
    let raw = mounted.mountpoint.join("raw");
    let got = run_loader("python3", "tensorflow", &["tfdata", raw.to_str().unwrap(), "--records"]).unwrap();
    assert!(without_file(&got) == source_records(&fx));
    rt.block_on(server.running.shutdown());
}
