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
use std::path::Path;
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

/// The bytes of file `rel` of `dataset` as the server sends them: the status, and the body (none where it
/// broke off). A stream reset before its head was sent (the head still queued when the body broke off)
/// is status 0 and no body.
fn get_file(rt: &tokio::runtime::Runtime, server: &common::Server, dataset: &str, rel: &str) -> (u16, Option<Vec<u8>>) {
    let url = format!("{}{}", server.base, batchfs::api::file_path(dataset, rel));
    rt.block_on(async {
        match common::h2c().get(url).send().await {
            Ok(r) => (r.status().as_u16(), r.bytes().await.ok().map(|b| b.to_vec())),
            Err(e) if e.is_request() && !e.is_connect() => (0, None),
            Err(e) => panic!("no answer at all: {e}"),
        }
    })
}

/// `path` replaced by a link to `target`, which is given `path`'s date first: the size-and-date guard
/// sees the file it indexed.
fn swap_for_link(path: &Path, target: &Path) {
    let date = std::fs::metadata(path).unwrap().modified().unwrap();
    std::fs::File::options().write(true).open(target).unwrap().set_modified(date).unwrap();
    std::fs::remove_file(path).unwrap();
    std::os::unix::fs::symlink(target, path).unwrap();
}

/// A file swapped, after indexing, for a link to a file out of the dataset's directory of its size and
/// date is never served: a file of a tree too large to map (opened at each read) and a file beside
/// TFRecord shards (`raw/`'s README, opened at each read), over HTTP (the first request breaks off, the
/// next are `409`) and through the mount (`EIO` at once). The server says which file changed; the other
/// files are served as before.
#[test]
fn a_file_swapped_for_a_link_out_of_the_dataset_is_never_served() {
    let rt = common::runtime();
    let tree = fixture(SourceFormat::Files, 24, 3000);
    let shards = fixture(SourceFormat::Tfrecord, 40, 3000);
    std::fs::write(shards.path.join("README"), vec![b'r'; 5000]).unwrap();
    // The 4 shards mapped, the tree's 24 files opened at each read.
    let limits = ServerLimits { max_mapped_shards: 4, ..ServerLimits::default() };
    let with = ServeWith { limits: Some(limits), ..ServeWith::default() };
    let server = rt.block_on(serve(&[("tree", &tree.path), ("d", &shards.path)], with));
    let files = crate::raw::tree(&tree.path);
    let mut names = files.keys();
    let (swapped, kept) = (names.next().unwrap().clone(), names.next().unwrap().clone());
    let outside = tempfile::tempdir().unwrap();
    for (dataset, root, rel) in [("tree", &tree.path, swapped.as_str()), ("d", &shards.path, "README")] {
        let path = root.join(rel);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(get_file(&rt, &server, dataset, rel), (200, Some(bytes.clone())), "{rel}");
        let secret = outside.path().join(dataset);
        std::fs::write(&secret, vec![0x5e; bytes.len()]).unwrap();
        swap_for_link(&path, &secret);
        let first = get_file(&rt, &server, dataset, rel);
        assert!(first.0 != 200 || first.1.is_none(), "{rel}: served through a link out of the dataset");
        assert_eq!(get_file(&rt, &server, dataset, rel).0, 409, "{rel}: refused from then on");
    }
    assert_eq!(get_file(&rt, &server, "tree", &kept), (200, Some(files[&kept].clone())));
    let url = format!("{}/healthz", server.base);
    let health = rt.block_on(async { common::h2c().get(url).send().await.unwrap().text().await.unwrap() });
    assert!(health.contains(&swapped) && health.contains("README"), "{health}");
    assert!(health.contains("leads out of the dataset's directory"), "{health}");
    let (_dir, mounted) = common::mount(&server, "tree", "timeout=30s");
    let started = Instant::now();
    let refused = std::fs::read(mounted.mountpoint.join("raw").join(&swapped)).unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(libc::EIO), "{refused}");
    assert!(started.elapsed() < Duration::from_secs(10), "refused, not timed out");
    assert_eq!(std::fs::read(mounted.mountpoint.join("raw").join(&kept)).unwrap(), files[&kept]);
    drop(mounted);
    rt.block_on(server.running.shutdown());
}

/// The links docs/FORMATS.md promises keep being served by files opened at each read: within the dataset's
/// directory however written (a class folder by an absolute link), and, with `--follow-links`, out of it
/// (a dataset of links into a shared store), a link made again to the same file (`ln -sf`) included; a
/// link pointed at another file of the store, of the same size and date, is refused.
#[test]
fn links_in_the_dataset_and_with_follow_links_out_of_it_are_served() {
    let rt = common::runtime();
    let limits = ServerLimits { max_mapped_shards: 1, ..ServerLimits::default() };
    // Within: the tree's class folders kept under a hidden folder and linked by absolute links.
    let tree = fixture(SourceFormat::Files, 24, 3000);
    let want = crate::raw::tree(&tree.path);
    std::fs::create_dir(tree.path.join(".classes")).unwrap();
    let classes: Vec<String> = want.keys().filter_map(|k| Some(k.split_once('/')?.0.to_owned())).collect();
    for class in classes.iter().collect::<std::collections::BTreeSet<_>>() {
        std::fs::rename(tree.path.join(class), tree.path.join(".classes").join(class)).unwrap();
        std::os::unix::fs::symlink(tree.path.join(".classes").join(class), tree.path.join(class)).unwrap();
    }
    let with = ServeWith { limits: Some(limits.clone()), ..ServeWith::default() };
    let server = rt.block_on(serve(&[("tree", &tree.path)], with));
    for (rel, bytes) in &want {
        assert_eq!(get_file(&rt, &server, "tree", rel), (200, Some(bytes.clone())), "{rel}");
    }
    rt.block_on(server.running.shutdown());
    // Out of it, with --follow-links: every shard a link into a store.
    let store = fixture(SourceFormat::Tfrecord, 40, 3000);
    let spare = store.path.join("spare");
    let ds = tempfile::tempdir().unwrap();
    let shards = crate::raw::tree(&store.path);
    for name in shards.keys() {
        std::os::unix::fs::symlink(store.path.join(name), ds.path().join(name)).unwrap();
    }
    let with = ServeWith { limits: Some(limits), follow_links: true, ..ServeWith::default() };
    let server = rt.block_on(serve(&[("d", ds.path())], with));
    let manifest = common::manifest_of(&rt, &server, "d", 0, "batch_size=10");
    assert_eq!(manifest.batches.len(), 4);
    let body = common::batch_body(&rt, &server, 0, 1, "batch_size=10");
    assert_eq!(
        (body.len() as u64, batchfs::crc::crc32c(&body)),
        (manifest.batches[1].bytes, manifest.batches[1].crc32c)
    );
    let names: Vec<&String> = shards.keys().collect();
    let link = ds.path().join(names[0]);
    std::fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink(store.path.join(names[0]), &link).unwrap();
    assert_eq!(get_file(&rt, &server, "d", names[0]), (200, Some(shards[names[0]].clone())), "ln -sf");
    std::fs::write(&spare, vec![0x5e; shards[names[1]].len()]).unwrap();
    swap_for_link(&ds.path().join(names[1]), &spare);
    let first = get_file(&rt, &server, "d", names[1]);
    assert!(first.0 != 200 || first.1.is_none(), "served through a link pointed elsewhere");
    assert_eq!(get_file(&rt, &server, "d", names[1]).0, 409);
    rt.block_on(server.running.shutdown());
}
