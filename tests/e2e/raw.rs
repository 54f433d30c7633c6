//! `raw/`: the dataset directory as it is on the server, for every source format: shards read in
//! verified ranges (a shard larger than the cache streams through it), the files beside them, and a
//! DALI index twin for each TFRecord shard that has none.

use crate::common::{self, fixture, serve, ServeWith};
use batchfs::index::SourceFormat;
use std::collections::BTreeMap;
use std::path::Path;

/// Every regular file under `dir` (hidden names skipped), by path, with its bytes.
pub(crate) fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(dir.to_owned(), String::new())];
    while let Some((at, rel)) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().into_string().unwrap();
            if name.starts_with('.') {
                continue;
            }
            let path = if rel.is_empty() { name } else { format!("{rel}/{name}") };
            if entry.file_type().unwrap().is_dir() {
                stack.push((entry.path(), path));
            } else {
                out.insert(path, std::fs::read(entry.path()).unwrap());
            }
        }
    }
    out
}

/// What `tfrecord2idx` writes for a TFRecord file: each record's offset and frame size.
fn tfrecord2idx(shard: &[u8]) -> Vec<u8> {
    let mut out = String::new();
    let mut at = 0;
    while at < shard.len() {
        let frame = u64::from_le_bytes(shard[at..at + 8].try_into().unwrap()) as usize + 16;
        out.push_str(&format!("{at} {frame}\n"));
        at += frame;
    }
    out.into_bytes()
}

#[test]
fn raw_mirrors_a_tfrecord_dataset_with_shards_larger_than_the_cache() {
    let rt = common::runtime();
    // Four shards of about 22 MB (six 4 MiB chunks each) through a 16 MiB cache. Batches of one sample,
    // so that two of the largest (the tail's megabytes) fit too.
    let fx = fixture(SourceFormat::Tfrecord, 720, 120_000);
    let theirs = "train-00003-of-00004.tfrecord.idx";
    std::fs::write(fx.path.join(theirs), b"the user's own index\n").unwrap();
    std::fs::create_dir(fx.path.join("meta")).unwrap();
    std::fs::write(fx.path.join("meta/labels.txt"), b"cat\ndog\n").unwrap();
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let mut want = tree(&fx.path);
    let shards: Vec<String> = want.keys().filter(|p| p.ends_with(".tfrecord")).cloned().collect();
    assert_eq!(shards.len(), 4);
    for shard in &shards[..3] {
        let twin = tfrecord2idx(&want[shard]);
        want.insert(format!("{shard}.idx"), twin);
    }
    for passthrough in [true, false] {
        let (_dir, mounted) =
            common::mount(&server, "d", &format!("batch_size=1,cache=16M,prefetch=4,passthrough={passthrough}"));
        let raw = mounted.mountpoint.join("raw");
        let got = tree(&raw);
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "the same files");
        for (path, bytes) in &want {
            assert!(got[path] == *bytes, "raw/{path} differs (passthrough={passthrough})");
            assert_eq!(std::fs::metadata(raw.join(path)).unwrap().len(), bytes.len() as u64);
        }
        // A mapping (DALI's default reader) sees the same bytes, and so does a reader seeking around.
        let shard = std::fs::File::open(raw.join(&shards[1])).unwrap();
        assert!(common::map_file(&shard) == want[&shards[1]]);
        let mut piece = vec![0; 5000];
        for at in [9_000_000u64, 4 * 1024 * 1024 - 2500, 17] {
            std::os::unix::fs::FileExt::read_exact_at(&shard, &mut piece, at).unwrap();
            assert!(piece[..] == want[&shards[1]][at as usize..at as usize + 5000], "at {at}");
        }
        drop(shard);
        let stats = common::mount_stats(&mounted.mountpoint);
        let n = |k: &str| stats[k].as_u64().unwrap();
        assert_eq!((n("checksum_errors"), n("errors")), (0, 0), "{stats}");
        assert!(n("prefetches") >= 8, "the chunks ahead of each reader are prefetched: {stats}");
        assert!(n("cache_bytes") <= 16 << 20, "{stats}");
        drop(mounted);
    }
    rt.block_on(server.running.shutdown());
}

#[test]
fn raw_mirrors_lmdb_and_tar_datasets_and_hides_the_index_and_the_lock_file() {
    let rt = common::runtime();
    let lmdb = fixture(SourceFormat::Lmdb, 50, 2000);
    std::fs::write(lmdb.path.join("lock.mdb"), b"readers' state").unwrap();
    // An environment written as one file (subdir=False) at data.mdb locks with data.mdb-lock.
    std::fs::write(lmdb.path.join("data.mdb-lock"), b"readers' state").unwrap();
    let tars = fixture(SourceFormat::Tar, 12, 3000);
    let server = rt.block_on(serve(&[("l", &lmdb.path), ("w", &tars.path)], ServeWith::default()));
    for (name, fx) in [("l", &lmdb), ("w", &tars)] {
        let (_dir, mounted) = common::mount(&server, name, "batch_size=4");
        let mut want = tree(&fx.path);
        want.remove("lock.mdb");
        want.remove("data.mdb-lock");
        let got = tree(&mounted.mountpoint.join("raw"));
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{name}");
        assert!(got == want, "{name}: the bytes differ");
        assert!(!mounted.mountpoint.join("raw/.batchfs-index").exists());
        drop(mounted);
    }
    rt.block_on(server.running.shutdown());
}

/// A dataset indexed again with other files under a mount (the server restarted over a new tree): a
/// directory of `raw/` first looked into after it fails to list with `EIO` at once (its listing is of
/// another index than the mount's), never showing the new files beside the ones listed before; what was
/// listed before still lists as it was.
#[test]
fn a_directory_first_listed_after_the_dataset_was_indexed_again_fails_at_once_never_mixing() {
    let rt = common::runtime();
    let mut fx = fixture(SourceFormat::Files, 60, 3_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_dir, mounted) = common::mount(&server, "d", "timeout=20s");
    let raw = mounted.mountpoint.join("raw");
    let before = common::names_in(&raw.join("class-0000")).unwrap();
    assert!(!before.is_empty());
    let server = common::index_again(&rt, server, &mut fx);
    assert!(fx.path.join("class-0001").is_dir(), "a folder of both trees: its listing is the new index's");
    let started = std::time::Instant::now();
    let err = common::names_in(&raw.join("class-0001")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "at once, not after timeout");
    assert_eq!(common::names_in(&raw.join("class-0000")).unwrap(), before, "listed before: as it was");
    drop(mounted);
    rt.block_on(server.running.shutdown());
}
