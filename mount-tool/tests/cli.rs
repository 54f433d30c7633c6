//! The `batchfs` binary against a real server: daemonized mount, stats, umount, the errors a mount
//! reports before daemonizing, a stale mount left by a killed daemon, the fstab helper through
//! util-linux `mount -T`, memory held under the cache budget while reading an epoch four times larger
//! than the cache, and the energy log of a mount. (The lab tools' tests are `lab/tests/cli.rs`.)

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_batchfs");

type Server = batchfs_server::testing::GeneratedServer;

fn server(samples: u32, mean_bytes: u64, token: Option<&str>) -> Server {
    batchfs_server::testing::serve_generated(samples, mean_bytes, token)
}

/// Batch `batch` of epoch 0 with plan options `query`, straight from the server.
fn server_batch(server: &Server, query: &str, batch: u64) -> Vec<u8> {
    let base = server.url.trim_end_matches("/d");
    let url = format!("{base}{}?{query}", batchfs::api::batch_path("d", 0, batch));
    server.runtime.block_on(async {
        let client = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
        let response = client.get(url).send().await.unwrap();
        assert!(response.status().is_success(), "{}", response.status());
        response.bytes().await.unwrap().to_vec()
    })
}

/// Unmounts (lazily) on drop, so a failing test leaves nothing mounted.
use batchfs_mount::plan::UnmountOnDrop as MountGuard;

fn batchfs(args: &[&str]) -> Output {
    Command::new(BIN).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn is_mounted(path: &Path) -> bool {
    batchfs_mount::plan::is_mountpoint(path)
}

#[test]
fn daemonized_mount_stats_and_umount() {
    let server = server(64, 4000, None);
    let dir = tempfile::tempdir().unwrap();
    let mnt = std::fs::canonicalize(dir.path()).unwrap();
    let out = batchfs(&["mount", &server.url, mnt.to_str().unwrap(), "-o", "batch_size=8,prefetch=4", "--epochs", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let _guard = MountGuard(mnt.clone());
    assert!(is_mounted(&mnt), "the command returns once the mount is ready");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = mountinfo.lines().find(|l| l.split(' ').nth(4) == mnt.to_str()).unwrap();
    assert!(line.contains(&format!(" - fuse.batchfs {} ", server.url)), "{line}");
    assert_eq!(std::fs::read_dir(&mnt).unwrap().count(), 6, ".batchfs, raw, rolling and three epochs");
    for b in 0..8 {
        let body = std::fs::read(mnt.join(format!("epoch-0001/batch-{b:06}.tfrecord"))).unwrap();
        assert!(batchfs::tfrecord::Scanner::new(&body, true).all(|r| r.is_ok()));
    }
    let table = batchfs(&["stats", mnt.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("cache hits"), "{table:?}");
    let json = batchfs(&["stats", "--json", mnt.to_str().unwrap()]);
    let stats: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert!(stats["bytes_served"].as_u64().unwrap() > 0);
    // A file held open keeps the mount busy past the grace given to files just closed.
    let held = std::fs::File::open(mnt.join("epoch-0001/batch-000000.tfrecord")).unwrap();
    let busy = batchfs(&["umount", mnt.to_str().unwrap()]);
    assert!(stderr(&busy).contains("is busy (files open)"), "{}", stderr(&busy));
    assert!(is_mounted(&mnt));
    drop(held);
    let out = batchfs(&["umount", mnt.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!is_mounted(&mnt));
    let again = batchfs(&["umount", mnt.to_str().unwrap()]);
    assert!(stderr(&again).contains("is not mounted"), "{}", stderr(&again));

    // Another filesystem is left alone (it was unmounted before, a tmpfs as readily as a batchfs mount).
    let status = Command::new("mount").args(["-t", "tmpfs", "tmpfs"]).arg(&mnt).status().unwrap();
    assert!(status.success());
    let _tmpfs = MountGuard(mnt.clone());
    let other = batchfs(&["umount", mnt.to_str().unwrap()]);
    assert!(stderr(&other).contains("is not a batchfs mount (tmpfs"), "{}", stderr(&other));
    assert!(is_mounted(&mnt), "the tmpfs stays");
}

/// A daemonized mount's `log_file` whose directory went away: a worker replacing the first one (killed)
/// cannot open it, and logs to the supervisor's stderr instead of exiting (the supervisor retried, then
/// failed every read with EIO), so the mount serves on.
#[test]
fn a_worker_whose_log_file_went_away_serves_on() {
    let server = server(64, 4000, None);
    let dir = tempfile::tempdir().unwrap();
    let mnt = std::fs::canonicalize(dir.path()).unwrap().join("mnt");
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&mnt).unwrap();
    std::fs::create_dir(&logs).unwrap();
    let options = format!("batch_size=8,log_file={}", logs.join("mount.log").display());
    let out = batchfs(&["mount", &server.url, mnt.to_str().unwrap(), "-o", &options]);
    assert!(out.status.success(), "{}", stderr(&out));
    let _guard = MountGuard(mnt.clone());
    let stats = || -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(mnt.join(".batchfs/stats")).unwrap()).unwrap()
    };
    let first = stats()["worker_pid"].as_u64().unwrap();
    std::fs::remove_dir_all(&logs).unwrap();
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(first as libc::pid_t, libc::SIGKILL) }, 0);
    wait_until("a second worker", || {
        std::fs::read(mnt.join(".batchfs/stats"))
            .ok()
            .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok())
            .and_then(|s| s["worker_pid"].as_u64())
            .is_some_and(|pid| pid != first)
    });
    for b in 0..8 {
        let body = std::fs::read(mnt.join(format!("epoch-0000/batch-{b:06}.tfrecord"))).unwrap();
        assert_eq!(body, server_batch(&server, "batch_size=8", b), "batch {b}");
    }
    assert!(batchfs(&["umount", mnt.to_str().unwrap()]).status.success());
}

#[test]
fn mount_errors_are_reported_before_daemonizing() {
    let server = server(16, 2000, Some("secret"));
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().to_str().unwrap().to_owned();
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://127.0.0.1:{}/d", l.local_addr().unwrap().port())
    };
    let token = dir.path().join("token");
    std::fs::write(&token, "wrong\n").unwrap();
    let good_token = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(good_token.path(), "secret").unwrap();
    let unknown = server.url.replace("/d", "/nope");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec![dead, mnt.clone()], "cannot reach or talk to the server"),
        (vec![unknown, mnt.clone(), "-o".into(), format!("token_file={}", good_token.path().display())], "unknown"),
        (
            vec![server.url.clone(), mnt.clone(), "-o".into(), format!("token_file={}", token.display())],
            "refused the token",
        ),
        (vec![server.url.clone(), mnt.clone()], "refused the token"),
        (vec![server.url.clone(), "/nonexistent/mnt".into()], "mountpoint /nonexistent/mnt"),
        (vec![server.url.clone(), mnt.clone(), "-o".into(), "colour=red".into()], "unknown mount option"),
        (vec!["storage:7878/d".into(), mnt.clone()], "expected http(s)://host:port/DATASET"),
        // A log file that cannot be written (its logs were lost without a word), and an energy log a worker
        // cannot write (the supervisor said only that the worker exited).
        (
            vec![server.url.clone(), mnt.clone(), "-o".into(), "log_file=/nonexistent/dir/x.log".into()],
            "cannot open log_file /nonexistent/dir/x.log",
        ),
        (
            vec![
                server.url.clone(),
                mnt.clone(),
                "-o".into(),
                format!("token_file={},energy_log=/nonexistent/e.jsonl", good_token.path().display()),
            ],
            "cannot write energy_log /nonexistent/e.jsonl",
        ),
        // 16 samples, batches of 32 whose partial one is dropped: every epoch empty (it mounted so).
        (
            vec![
                server.url.clone(),
                mnt.clone(),
                "-o".into(),
                format!("token_file={},batch_size=32,drop_last", good_token.path().display()),
            ],
            "drops every epoch's only batch",
        ),
    ];
    for (args, needle) in cases {
        let mut full = vec!["mount".to_owned()];
        full.extend(args);
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        let out = batchfs(&refs);
        assert!(!out.status.success(), "{full:?} succeeded");
        assert!(stderr(&out).contains(needle), "{full:?}: {:?} lacks {needle:?}", stderr(&out));
        // A worker's reason alone: the supervisor's own SIGKILL after it read as a crash.
        assert!(!stderr(&out).contains("SIGKILL"), "{full:?}: {:?}", stderr(&out));
        assert!(!is_mounted(dir.path()));
    }
    // Busy: something is already mounted there.
    let ok = batchfs(&["mount", &server.url, &mnt, "-o", &format!("token_file={}", good_token.path().display())]);
    assert!(ok.status.success(), "{}", stderr(&ok));
    let _guard = MountGuard(std::fs::canonicalize(&mnt).unwrap());
    let busy = batchfs(&["mount", &server.url, &mnt, "-o", &format!("token_file={}", good_token.path().display())]);
    assert!(stderr(&busy).contains("is busy"), "{}", stderr(&busy));
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn foreground(url: &str, mnt: &Path, options: &str) -> Child {
    Command::new(BIN)
        .args(["mount", url, mnt.to_str().unwrap(), "--foreground", "-o", options])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn a_stale_mount_of_a_killed_daemon_is_cleaned_up() {
    let server = server(16, 2000, None);
    let dir = tempfile::tempdir().unwrap();
    let mnt = std::fs::canonicalize(dir.path()).unwrap();
    let _guard = MountGuard(mnt.clone());
    let mut child = foreground(&server.url, &mnt, "batch_size=4");
    wait_until("the mount", || is_mounted(&mnt));
    // The daemon is a supervisor (`child`) and its worker, which goes with it a moment later; an access
    // the worker had read as it went fails with ECONNABORTED, the next ones with ENOTCONN.
    let stats: serde_json::Value = serde_json::from_slice(&std::fs::read(mnt.join(".batchfs/stats")).unwrap()).unwrap();
    let worker = stats["worker_pid"].as_u64().unwrap() as i32;
    child.kill().unwrap();
    child.wait().unwrap();
    wait_until("the worker to go with its supervisor", || {
        // Gone, or a zombie (nothing left of it but its exit status).
        std::fs::read_to_string(format!("/proc/{worker}/stat")).map_or(true, |s| s.contains(") Z "))
    });
    // A request already queued as the connection went fails with ECONNABORTED; then every access gets
    // ENOTCONN.
    let deadline = Instant::now() + Duration::from_secs(5);
    let err = loop {
        let err = std::fs::read_dir(&mnt).unwrap_err();
        if err.raw_os_error() != Some(libc::ECONNABORTED) || Instant::now() > deadline {
            break err;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOTCONN), "a dead daemon leaves 'Transport endpoint is not connected'");
    let out = batchfs(&["mount", &server.url, mnt.to_str().unwrap(), "-o", "batch_size=4"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let got = std::fs::read(mnt.join("epoch-0000/batch-000000.tfrecord")).unwrap();
    assert_eq!(got, server_batch(&server, "batch_size=4", 0), "the new mount serves the server's bytes");
}

/// SIGHUP to a mount without a supervisor (a closed terminal, or an operator who meant an upgrade) killed
/// its only process and left the mountpoint "not connected": it is ignored, with a warning, and SIGTERM
/// still unmounts.
#[test]
fn an_unsupervised_mount_serves_through_sighup_and_unmounts_at_sigterm() {
    let server = server(16, 2000, None);
    let dir = tempfile::tempdir().unwrap();
    let mnt = std::fs::canonicalize(dir.path()).unwrap();
    let _guard = MountGuard(mnt.clone());
    let mut command = Command::new(BIN);
    command.args(["mount", &server.url, mnt.to_str().unwrap(), "--foreground", "-o", "batch_size=4,supervise=false"]);
    // SIGHUP's default in the mount whatever the test's (under `nohup` it is ignored, and so would be
    // passed on): the test must see what the mount does with it.
    // SAFETY: `signal` is async-signal-safe, and the closure touches nothing else of the parent.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
            Ok(())
        })
    };
    let mut child = command.env("RUST_LOG", "warn").stdout(Stdio::null()).spawn().unwrap();
    wait_until("the mount", || is_mounted(&mnt));
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGHUP) }, 0);
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.try_wait().unwrap().is_none(), "SIGHUP stopped the mount");
    let got = std::fs::read(mnt.join("epoch-0000/batch-000000.tfrecord")).unwrap();
    assert_eq!(got, server_batch(&server, "batch_size=4", 0));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    wait_until("the unmount", || !is_mounted(&mnt));
    assert!(child.wait().unwrap().success());
}

#[test]
fn fstab_entries_mount_with_mount_t() {
    let server = server(16, 2000, None);
    let dir = tempfile::tempdir().unwrap();
    let mnt = std::fs::canonicalize(dir.path()).unwrap().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let fstab = dir.path().join("fstab");
    std::fs::write(
        &fstab,
        format!("# test fstab\n{} {} batchfs _netdev,batch_size=4,prefetch=2 0 0\n", server.url, mnt.display()),
    )
    .unwrap();
    // mount(8) runs /sbin/mount.batchfs for type batchfs; install it as the README says, for this test.
    let helper = Path::new("/sbin/mount.batchfs");
    let installed_here = !helper.exists();
    if installed_here {
        std::os::unix::fs::symlink(BIN, helper).expect("install /sbin/mount.batchfs (run the tests as root)");
    }
    struct Uninstall(bool);
    impl Drop for Uninstall {
        fn drop(&mut self) {
            if self.0 {
                let _ = std::fs::remove_file("/sbin/mount.batchfs");
            }
        }
    }
    let _uninstall = Uninstall(installed_here);
    let _guard = MountGuard(mnt.clone());
    let out = Command::new("mount").arg("-T").arg(&fstab).arg(&mnt).output().unwrap();
    assert!(out.status.success(), "mount -T: {}", stderr(&out));
    assert!(is_mounted(&mnt));
    let got = std::fs::read(mnt.join("epoch-0000/batch-000003.tfrecord")).unwrap();
    assert_eq!(got, server_batch(&server, "batch_size=4", 3), "the fstab options (batch_size=4) are applied");
    let out = Command::new("umount").arg(&mnt).output().unwrap();
    assert!(out.status.success(), "umount: {}", stderr(&out));
    // mount -a with the same fstab mounts every entry.
    let out = Command::new("mount").arg("-T").arg(&fstab).arg("-a").output().unwrap();
    assert!(out.status.success(), "mount -a: {}", stderr(&out));
    assert!(is_mounted(&mnt));
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[test]
fn memory_stays_under_the_cache_budget() {
    // An epoch of ~290 MB read through a mount whose cache is 64 MiB.
    let server = server(2600, 110_000, None);
    let dir = tempfile::tempdir().unwrap();
    let mnt = std::fs::canonicalize(dir.path()).unwrap();
    let _guard = MountGuard(mnt.clone());
    let cache = 64u64 << 20;
    let mut child = foreground(&server.url, &mnt, "batch_size=32,prefetch=8,cache=64M");
    let pid = child.id();
    wait_until("the mount", || is_mounted(&mnt));
    let done = std::sync::atomic::AtomicBool::new(false);
    let (bytes, peak) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut peak = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_bytes(pid));
                std::thread::sleep(Duration::from_millis(5));
            }
            peak
        });
        let mut bytes = 0u64;
        let epoch = mnt.join("epoch-0000");
        let mut names: Vec<_> = std::fs::read_dir(&epoch).unwrap().map(|e| e.unwrap().path()).collect();
        names.retain(|p| p.extension().is_some_and(|e| e == "tfrecord"));
        names.sort();
        for path in names {
            bytes += std::fs::read(path).unwrap().len() as u64;
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        (bytes, sampler.join().unwrap())
    });
    assert!(bytes > 4 * cache, "the epoch ({bytes} bytes) must be over four times the cache");
    let margin = 48 << 20;
    assert!(
        peak > 0 && peak <= cache + margin,
        "peak RSS {} MiB over the {} MiB budget + {} MiB",
        peak >> 20,
        cache >> 20,
        margin >> 20
    );
    eprintln!("read {} MiB; peak RSS of the mount {} MiB (cache {} MiB)", bytes >> 20, peak >> 20, cache >> 20);
    let _ = batchfs(&["umount", mnt.to_str().unwrap()]);
    child.wait().unwrap();
}

#[test]
fn a_mount_records_an_energy_log_with_the_bytes_it_served() {
    let server = server(32, 4000, None);
    let dir = tempfile::tempdir().unwrap();
    let mnt = std::fs::canonicalize(dir.path()).unwrap().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let log = dir.path().join("energy.jsonl");
    let _guard = MountGuard(mnt.clone());
    let mut child = foreground(&server.url, &mnt, &format!("batch_size=4,energy_log={}", log.display()));
    wait_until("the mount", || is_mounted(&mnt));
    std::thread::sleep(Duration::from_millis(400));
    let mut read = 0;
    for b in 0..8 {
        read += std::fs::read(mnt.join(format!("epoch-0000/batch-{b:06}.tfrecord"))).unwrap().len() as u64;
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(batchfs(&["umount", mnt.to_str().unwrap()]).status.success());
    assert!(child.wait().unwrap().success());
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let samples = &lines[..lines.len() - 1];
    assert!(samples.len() >= 5, "{}", samples.len());
    assert_eq!(samples.last().unwrap()["bytes"].as_u64(), Some(read), "the timeline carries the bytes served");
    assert_eq!(lines.last().unwrap()["summary"]["bytes"].as_u64(), Some(read));
}

/// `batchfs warm` fills a node cache with every file of a file tree, without a mount (a mount with that
/// `cache_dir` then fetches nothing); a dataset of shards is refused with the reason.
#[test]
fn warm_fills_a_node_cache_without_a_mount() {
    let server = batchfs_server::testing::serve_generated_as(batchfs::index::SourceFormat::Files, 120, 5000, None);
    let cache = tempfile::tempdir().unwrap();
    let option = format!("cache_dir={}", cache.path().display());
    let out = batchfs(&["warm", &server.url, "-o", &option]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("warmed 120/120 files"), "{:?}", out);
    let files: usize =
        std::fs::read_dir(cache.path()).unwrap().map(|d| std::fs::read_dir(d.unwrap().path()).unwrap().count()).sum();
    assert_eq!(files, 120);
    // Again: nothing left to fetch.
    let again = batchfs(&["warm", &server.url, "-o", &option]);
    assert!(String::from_utf8_lossy(&again.stdout).contains("warmed 120/120 files"), "{:?}", again);
    assert!(!String::from_utf8_lossy(&again.stdout).contains("evicted"), "{:?}", again);
    // Into a cache smaller than the files (100 KB for 120 files of ~5 KB): it said every file was warmed
    // where a fraction stayed; it says what the cache holds, and the size that would hold them.
    let small = tempfile::tempdir().unwrap();
    let option = format!("cache_dir={},cache_dir_size=100K", small.path().display());
    let out = batchfs(&["warm", &server.url, "-o", &option]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && said.contains("were evicted to make room"), "{out:?}");
    assert!(said.contains("the node cache holds") && said.contains("give cache_dir_size at least"), "{said}");
    let option = format!("cache_dir={}", cache.path().display());
    let shards = server_of_shards();
    let refused = batchfs(&["warm", &shards.url, "-o", &option]);
    assert!(!refused.status.success());
    assert!(stderr(&refused).contains("file tree"), "{}", stderr(&refused));
    let none = batchfs(&["warm", &server.url]);
    assert!(stderr(&none).contains("cache_dir"), "{}", stderr(&none));
}

/// `batchfs warm DIR` of a mount with a cache_dir: the files below DIR (a class folder of `raw/`), into
/// the mount's own cache_dir, then the whole tree from the mount's root.
#[test]
fn warm_a_directory_of_a_mount_into_its_node_cache() {
    let server = batchfs_server::testing::serve_generated_as(batchfs::index::SourceFormat::Files, 90, 4000, None);
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mnt = std::fs::canonicalize(dir.path()).unwrap();
    let option = format!("cache_dir={}", cache.path().display());
    let out = batchfs(&["mount", &server.url, mnt.to_str().unwrap(), "-o", &option]);
    assert!(out.status.success(), "{}", stderr(&out));
    let _guard = MountGuard(mnt.clone());
    let count = || -> usize {
        std::fs::read_dir(cache.path()).unwrap().map(|d| std::fs::read_dir(d.unwrap().path()).unwrap().count()).sum()
    };
    let class = std::fs::read_dir(mnt.join("raw")).unwrap().next().unwrap().unwrap().path();
    let in_class = std::fs::read_dir(&class).unwrap().count();
    let out = batchfs(&["warm", class.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("warmed {in_class}/{in_class} files")), "{out:?}");
    assert_eq!(count(), in_class, "the class's files only");
    let out = batchfs(&["warm", mnt.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(count(), 90);
    let elsewhere = batchfs(&["warm", "/tmp"]);
    assert!(stderr(&elsewhere).contains("not in a batchfs mount"), "{}", stderr(&elsewhere));
    assert!(batchfs(&["umount", mnt.to_str().unwrap()]).status.success());
}

fn server_of_shards() -> Server {
    server(16, 2000, None)
}
