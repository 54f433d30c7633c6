//! The node cache (`cache_dir`) and warming (`warm=raw`) through real mounts of a real server, read by
//! torchvision's ImageFolder with a shuffled DataLoader over `raw/` and `shuffled/`, with a memory cache
//! far smaller than the dataset so that what is not fetched comes from the disk.

use crate::common::{self, fixture, serve, ServeWith};
use crate::shuffled::{epoch_of, imagefolder, tree};
use batchfs::index::SourceFormat;
use std::path::Path;

fn fetched(mountpoint: &Path) -> u64 {
    common::mount_stats(mountpoint)["fetched_bytes"].as_u64().unwrap()
}

/// Epochs after the first, and a remount with the same `cache_dir`, read nothing from the server; every
/// byte is right; a file corrupted on the disk is found and fetched anew.
#[test]
fn imagefolder_over_raw_with_a_node_cache_reads_the_server_once() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 400, 150_000);
    let want = tree(&fx.path);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let disk = tempfile::tempdir().unwrap();
    // The memory cache holds a quarter of the epoch: most of the second epoch cannot come from it.
    let options = format!("batch_size=1,cache=16M,cache_dir={}", disk.path().display());
    let (_dir, mounted) = common::mount(&server, "d", &options);
    let Some(got) = imagefolder(&mounted.mountpoint.join("raw"), 2) else { return };
    let records = got["records"].as_array().unwrap();
    assert_eq!(epoch_of(records, 0).0, want);
    assert_eq!(epoch_of(records, 1).0, want);
    let first = fetched(&mounted.mountpoint);
    let stats = common::mount_stats(&mounted.mountpoint);
    let epoch = got["bytes"].as_u64().unwrap() / 2;
    // Each file from the server once (a second fetch may start before the first is on the disk).
    assert!(first >= epoch && first <= epoch + epoch / 10, "{first} for an epoch of {epoch}: {stats}");
    assert!(stats["node_cache"]["hits"].as_u64().unwrap() >= 200, "the second epoch from the disk: {stats}");
    drop(mounted);

    // A remount with the same node cache: nothing from the server.
    let (_dir, mounted) = common::mount(&server, "d", &options);
    let Some(got) = imagefolder(&mounted.mountpoint.join("raw"), 1) else { return };
    assert_eq!(epoch_of(got["records"].as_array().unwrap(), 0).0, want);
    assert_eq!(fetched(&mounted.mountpoint), 0, "{}", common::mount_stats(&mounted.mountpoint));
    drop(mounted);

    // One file flipped on the disk: refused at its read, fetched anew, every byte still right.
    let mut files: Vec<_> = walk(disk.path());
    files.sort();
    let victim = &files[files.len() / 2];
    let mut bytes = std::fs::read(victim).unwrap();
    bytes[10] ^= 0x40;
    std::fs::write(victim, &bytes).unwrap();
    let (_dir, mounted) = common::mount(&server, "d", &options);
    let Some(got) = imagefolder(&mounted.mountpoint.join("raw"), 1) else { return };
    assert_eq!(epoch_of(got["records"].as_array().unwrap(), 0).0, want);
    let stats = common::mount_stats(&mounted.mountpoint);
    assert_eq!(stats["node_cache"]["corrupt"], 1, "{stats}");
    assert_eq!(stats["fetched_bytes"].as_u64().unwrap(), bytes.len() as u64, "only that file fetched: {stats}");
    rt.block_on(server.running.shutdown());
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

/// Two mounts sharing one `cache_dir`, read at the same time: every byte right in both.
#[test]
fn two_mounts_share_one_node_cache_under_concurrent_reads() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 500, 80_000);
    let want = tree(&fx.path);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let disk = tempfile::tempdir().unwrap();
    let options = format!("batch_size=1,cache=16M,cache_dir={}", disk.path().display());
    let (_a, one) = common::mount(&server, "d", &options);
    let (_b, two) = common::mount(&server, "d", &options);
    let readers: Vec<_> = [one.mountpoint.join("raw"), two.mountpoint.join("shuffled")]
        .into_iter()
        .map(|dir| std::thread::spawn(move || imagefolder(&dir, 2)))
        .collect();
    let mut epoch = 0;
    for r in readers {
        let Some(got) = r.join().unwrap() else { return };
        let records = got["records"].as_array().unwrap();
        assert_eq!(epoch_of(records, 0).0, want);
        assert_eq!(epoch_of(records, 1).0, want);
        epoch = got["bytes"].as_u64().unwrap() / 2;
    }
    // Four epochs read, through memory caches of a fraction of one: without the shared disk each mount
    // would fetch about two. Together they fetched one and a part (a file both asked for at once comes
    // twice; what either fetched, the other found on the disk).
    let total: u64 = [&one, &two].iter().map(|m| fetched(&m.mountpoint)).sum();
    assert!(total >= epoch && total <= 2 * epoch, "{total} fetched for an epoch of {epoch}");
    rt.block_on(server.running.shutdown());
}

/// `warm=raw` fills the node cache with every file, in batches; then ImageFolder over `raw/` and over
/// `shuffled/` fetches nothing, each file handed to the kernel as the node cache's own.
#[test]
fn warm_raw_fills_the_node_cache_so_readers_fetch_nothing() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 300, 30_000);
    let want = tree(&fx.path);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let disk = tempfile::tempdir().unwrap();
    let options = format!("batch_size=1,cache=16M,warm=raw,cache_dir={}", disk.path().display());
    let (_dir, mounted) = common::mount(&server, "d", &options);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let stats = common::mount_stats(&mounted.mountpoint);
        let warm = &stats["warm"];
        if warm["files"].as_u64().is_some() && warm["files"] == warm["files_total"] {
            assert_eq!(warm["files_total"], 300, "{stats}");
            assert_eq!(warm["bytes"], warm["bytes_total"], "{stats}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "warming did not end: {stats}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let warmed = fetched(&mounted.mountpoint);
    assert_eq!(walk(disk.path()).len(), 300, "one file per sample");
    let n = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap();
    for view in ["raw", "shuffled"] {
        let before = common::mount_stats(&mounted.mountpoint);
        let Some(got) = imagefolder(&mounted.mountpoint.join(view), 1) else { return };
        assert_eq!(epoch_of(got["records"].as_array().unwrap(), 0).0, want, "{view}");
        let stats = common::mount_stats(&mounted.mountpoint);
        let (lookups, opens) = (n(&stats, "lookups") - n(&before, "lookups"), n(&stats, "passthrough_opens"));
        if view == "shuffled" {
            // Every open of a name of shuffled/ is a lookup: the sample is handed out there.
            assert!(lookups >= 300, "{lookups} lookups for 300 opens: {stats}");
            if stats["passthrough"] == true {
                // Each sample handed to the kernel as the node cache's own file, its group never read into
                // memory: every byte a hit of the node cache once (read by the open's check, or known
                // checked: warming wrote it).
                assert!(opens - n(&before, "passthrough_opens") >= 300, "{stats}");
                let hit = n(&stats["node_cache"], "hit_bytes") - n(&before["node_cache"], "hit_bytes");
                assert_eq!(hit, n(&stats["warm"], "bytes_total"), "{stats}");
            }
            continue;
        }
        // The walk's listings carried every name's entry: no lookup per file.
        assert!(lookups < 30, "{lookups} lookups for 300 files: {stats}");
        if stats["passthrough"] == true {
            // Each file handed to the kernel as the node cache's own file: nothing copied into memory.
            assert!(opens - n(&before, "passthrough_opens") >= 300, "{stats}");
            assert_eq!(n(&stats, "passthrough_bytes"), n(&before, "passthrough_bytes"), "{stats}");
        }
    }
    assert_eq!(fetched(&mounted.mountpoint), warmed, "nothing fetched after warming");
    // Without a cache_dir, warm=raw is refused before mounting.
    let dir = tempfile::tempdir().unwrap();
    let Err(err) = batchfs_mount::plan::plan(
        &format!("{}/d", server.base),
        dir.path(),
        batchfs_mount::options::MountOptions { warm: batchfs_mount::options::Warm::Raw, ..Default::default() },
    ) else {
        panic!("warm=raw without a cache_dir was accepted");
    };
    assert!(format!("{err:#}").contains("cache_dir"), "{err:#}");
    rt.block_on(server.running.shutdown());
}

/// A file the mount wrote into the node cache (or checked there) opens by passthrough without being read
/// again; one of them changed on the disk in place, a byte flipped at the same size while the mount lives,
/// is read at its next open, found wrong, removed and fetched anew: every byte through the mount right.
#[test]
fn a_node_cache_file_changed_after_its_check_is_checked_again() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 120, 40_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let disk = tempfile::tempdir().unwrap();
    let options = format!("batch_size=1,cache=16M,warm=raw,cache_dir={}", disk.path().display());
    let (_dir, mounted) = common::mount(&server, "d", &options);
    warmed(&mounted.mountpoint);
    let raw = mounted.mountpoint.join("raw");
    let mut names: Vec<_> = walk(&raw).into_iter().map(|p| p.strip_prefix(&raw).unwrap().to_owned()).collect();
    names.sort();
    assert_eq!(names.len(), 120);
    let read_all = || {
        for name in &names {
            let (got, want) = (std::fs::read(raw.join(name)).unwrap(), std::fs::read(fx.path.join(name)).unwrap());
            assert!(got == want, "{} read wrong through the mount", name.display());
        }
    };
    // Twice: on a filesystem whose times are a tick coarse, the first open of a file just written reads it.
    read_all();
    read_all();
    let n = |s: &serde_json::Value, k: &str| s["node_cache"][k].as_u64().unwrap();
    let stats = common::mount_stats(&mounted.mountpoint);
    let passthrough = stats["passthrough"] == true;
    if passthrough {
        assert!(n(&stats, "unread") >= names.len() as u64, "the second opens read nothing: {stats}");
    }
    let fetched_before = fetched(&mounted.mountpoint);

    let mut files = walk(disk.path());
    files.sort();
    let victim = &files[files.len() / 2];
    let size = std::fs::metadata(victim).unwrap().len();
    let f = std::fs::File::options().read(true).write(true).open(victim).unwrap();
    let mut byte = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut byte, 7).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[byte[0] ^ 0x20], 7).unwrap();
    drop(f);
    read_all();
    let stats = common::mount_stats(&mounted.mountpoint);
    if passthrough {
        assert_eq!(n(&stats, "corrupt"), 1, "{stats}");
        assert_eq!(fetched(&mounted.mountpoint) - fetched_before, size, "only that file fetched: {stats}");
    }
    rt.block_on(server.running.shutdown());
}

/// Waits until `warm=raw` has every file of the dataset in the node cache.
fn warmed(mountpoint: &Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let stats = common::mount_stats(mountpoint);
        let warm = &stats["warm"];
        if warm["files"].as_u64().is_some() && warm["files"] == warm["files_total"] {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "warming did not end: {stats}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A `raw/` file of several chunks (4 MiB each) that warming kept whole opens by passthrough from the
/// node cache's file, as a file of one chunk does; without passthrough its chunks are read from that file
/// through the daemon, each alone. Either way every byte is right and nothing more is fetched.
#[test]
fn a_file_of_several_chunks_kept_whole_is_read_from_the_node_cache() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 20, 30_000);
    let large: Vec<u8> = (0..9_500_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    std::fs::write(fx.path.join("large.bin"), &large).unwrap();
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let disk = tempfile::tempdir().unwrap();
    let n = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap();
    for passthrough in [true, false] {
        let options = format!("warm=raw,passthrough={passthrough},cache_dir={}", disk.path().display());
        let (_dir, mounted) = common::mount(&server, "d", &options);
        warmed(&mounted.mountpoint);
        let (before, fetched_before) = (common::mount_stats(&mounted.mountpoint), fetched(&mounted.mountpoint));
        let got = std::fs::read(mounted.mountpoint.join("raw/large.bin")).unwrap();
        assert!(got == large, "passthrough={passthrough}: {} bytes, not the file's", got.len());
        let stats = common::mount_stats(&mounted.mountpoint);
        assert_eq!(fetched(&mounted.mountpoint), fetched_before, "nothing fetched: {stats}");
        if passthrough && stats["passthrough"] == true {
            assert_eq!(n(&stats, "passthrough_opens") - n(&before, "passthrough_opens"), 1, "{stats}");
            assert_eq!(n(&stats, "daemon_opens"), n(&before, "daemon_opens"), "{stats}");
        }
        // The file checked whole at a passthrough open, or each of its three chunks read alone.
        let hit = n(&stats["node_cache"], "hit_bytes") - n(&before["node_cache"], "hit_bytes");
        assert_eq!(hit, large.len() as u64, "passthrough={passthrough}: {stats}");
    }
    rt.block_on(server.running.shutdown());
}

/// `b` with its last four bytes changed so that its CRC32C is `a`'s (same length): the CRC is affine in
/// those 32 bits, so their change solves a system over GF(2).
fn with_the_crc_of(a: &[u8], mut b: Vec<u8>) -> Vec<u8> {
    let crc = batchfs::crc::crc32c;
    let n = b.len();
    let zero = crc(&vec![0u8; n]);
    // The CRC's change for each bit of the last four bytes flipped alone.
    let columns: Vec<u32> = (0..32)
        .map(|i| {
            let mut x = vec![0u8; n];
            x[n - 4 + i / 8] = 1 << (i % 8);
            crc(&x) ^ zero
        })
        .collect();
    // Gaussian elimination: a basis by leading bit, each vector with the flips that make it.
    let mut basis: [(u32, u32); 32] = [(0, 0); 32];
    for (i, &column) in columns.iter().enumerate() {
        let (mut v, mut flips) = (column, 1u32 << i);
        while v != 0 {
            let top = 31 - v.leading_zeros() as usize;
            if basis[top].0 == 0 {
                basis[top] = (v, flips);
                break;
            }
            v ^= basis[top].0;
            flips ^= basis[top].1;
        }
    }
    let (mut want, mut flips) = (crc(a) ^ crc(&b), 0u32);
    while want != 0 {
        let top = 31 - want.leading_zeros() as usize;
        want ^= basis[top].0;
        flips ^= basis[top].1;
    }
    for i in 0..32 {
        if flips >> i & 1 == 1 {
            b[n - 4 + i / 8] ^= 1 << (i % 8);
        }
    }
    b
}

/// Two files of one size and CRC32C (which no check of size and CRC tells apart) each read as itself
/// through `raw/` and `shuffled/`, from the server and then from the node cache in a new mount. The node
/// cache filed objects by size and CRC alone, and served the first file's bytes for both.
#[test]
fn files_of_one_size_and_crc_each_read_as_themselves_from_the_node_cache() {
    let rt = common::runtime();
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("c")).unwrap();
    let a: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
    let b = with_the_crc_of(&a, (0..4096u32).map(|i| (i * 17 % 241) as u8).collect());
    assert!(a != b && a.len() == b.len() && batchfs::crc::crc32c(&a) == batchfs::crc::crc32c(&b));
    std::fs::write(root.path().join("c/a.bin"), &a).unwrap();
    std::fs::write(root.path().join("c/b.bin"), &b).unwrap();
    let server = rt.block_on(serve(&[("d", root.path())], ServeWith::default()));
    let disk = tempfile::tempdir().unwrap();
    let options = format!("batch_size=2,cache_dir={}", disk.path().display());
    let mut want = vec![a.clone(), b.clone()];
    want.sort();
    // The first mount fetches and files both; the second reads both from the disk.
    for mount in 0..2 {
        let (_dir, mounted) = common::mount(&server, "d", &options);
        let raw = mounted.mountpoint.join("raw/c");
        assert!(std::fs::read(raw.join("a.bin")).unwrap() == a, "mount {mount}: a.bin");
        assert!(std::fs::read(raw.join("b.bin")).unwrap() == b, "mount {mount}: b.bin is a.bin");
        let shuffled = mounted.mountpoint.join("shuffled/c");
        let mut names: Vec<_> = std::fs::read_dir(&shuffled).unwrap().map(|e| e.unwrap().path()).collect();
        names.sort();
        let mut got: Vec<Vec<u8>> = names.iter().map(|p| std::fs::read(p).unwrap()).collect();
        got.sort();
        assert!(got == want, "mount {mount}: shuffled/ gave one file for the other");
        let stats = || common::mount_stats(&mounted.mountpoint);
        if mount == 0 {
            // Filed in the background: both on the disk before the next mount.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while stats()["node_cache"]["written_bytes"].as_u64().unwrap() < 2 * 4096 {
                assert!(std::time::Instant::now() < deadline, "never filed: {}", stats());
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        } else {
            assert_eq!(stats()["fetched_bytes"], 0, "from the node cache: {}", stats());
        }
    }
    rt.block_on(server.running.shutdown());
}

/// A shared `cache_dir` (the CSI plugin's volumes may name one below its cache folder) read by mounts of
/// two servers, each with a dataset `d` holding `c/x.bin` of one size and CRC32C but other bytes (a CRC is
/// no authentication: anyone can forge one): each mount reads its own server's bytes, also from the disk
/// in a second mount. Objects were filed under the dataset's name alone, so the second server's mount
/// read the first's bytes from the node cache.
#[test]
fn mounts_of_two_servers_sharing_a_node_cache_each_read_their_own_server_s_bytes() {
    let rt = common::runtime();
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
    let b = with_the_crc_of(&a, (0..4096u32).map(|i| (i * 17 % 241) as u8).collect());
    assert!(a != b && batchfs::crc::crc32c(&a) == batchfs::crc::crc32c(&b));
    for (root, bytes) in [(&one, &a), (&two, &b)] {
        std::fs::create_dir(root.path().join("c")).unwrap();
        std::fs::write(root.path().join("c/x.bin"), bytes).unwrap();
    }
    let first = rt.block_on(serve(&[("d", one.path())], ServeWith::default()));
    let second = rt.block_on(serve(&[("d", two.path())], ServeWith::default()));
    let disk = tempfile::tempdir().unwrap();
    let options = format!("batch_size=1,cache_dir={}", disk.path().display());
    for round in 0..2 {
        for (server, want) in [(&first, &a), (&second, &b)] {
            let (_dir, mounted) = common::mount(server, "d", &options);
            let got = std::fs::read(mounted.mountpoint.join("raw/c/x.bin")).unwrap();
            assert!(&got == want, "round {round}, server {}: another server's bytes", server.base);
            let shuffled = mounted.mountpoint.join("shuffled/c");
            let name = std::fs::read_dir(&shuffled).unwrap().next().unwrap().unwrap().path();
            assert!(&std::fs::read(name).unwrap() == want, "round {round}: shuffled/ gave another server's");
            // Filed in the background: on the disk before the next mount.
            let stats = || common::mount_stats(&mounted.mountpoint);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while round == 0 && stats()["node_cache"]["written_bytes"].as_u64().unwrap() < 4096 {
                assert!(std::time::Instant::now() < deadline, "never filed: {}", stats());
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            if round == 1 {
                assert_eq!(stats()["fetched_bytes"], 0, "from the node cache: {}", stats());
            }
        }
    }
    rt.block_on(first.running.shutdown());
    rt.block_on(second.running.shutdown());
}

/// Warming (`batchfs warm`, `warm=raw`) waits out a server restarted while it warms, within `timeout`, as
/// a mount's reads do: every file warmed, each byte the server's. It gave a request up after 5 attempts
/// (some 3 s), its files left unwarmed.
#[test]
fn warming_waits_out_a_server_restarted_meanwhile() {
    use batchfs_mount::client::DynClient;
    use std::sync::Arc;
    use std::time::Duration;
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Files, 60, 5000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let options = batchfs_mount::options::MountOptions::default();
    let http = batchfs_mount::plan::http_config(&format!("{}/d", server.base), &options).unwrap();
    let client: DynClient = Arc::new(batchfs_mount::client::HttpClient::new(http).unwrap());
    let table = Arc::new(rt.block_on(client.sample_table()).unwrap());
    let disk = tempfile::tempdir().unwrap();
    let cache = batchfs_mount::node_cache::NodeCache::open(disk.path(), 1 << 30, "d").unwrap();
    let order: Vec<u32> = (0..table.bytes.len() as u32).collect();
    let addr = server.running.local_addr();
    rt.block_on(server.running.shutdown());
    let path = fx.path.clone();
    let restarted = rt.spawn(async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        common::serve_on(addr, &[("d", &path)]).await
    });
    let stats = Arc::new(batchfs_mount::stats::Stats::default());
    let warm = batchfs_mount::warm::warm(client, cache.clone(), table.clone(), order, stats, Duration::from_secs(40));
    assert_eq!(rt.block_on(warm), 0, "every file warmed");
    let files = crate::raw::tree(&fx.path);
    assert_eq!(files.len(), 60);
    let mut held = 0;
    for entry in walk(disk.path()) {
        let bytes = std::fs::read(&entry).unwrap();
        assert!(files.values().any(|f| *f == bytes), "{} holds bytes of no file", entry.display());
        held += 1;
    }
    assert_eq!(held, 60);
    rt.block_on(rt.block_on(restarted).unwrap().running.shutdown());
}
