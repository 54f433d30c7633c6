//! The mount outlives its worker: `batchfs mount` (the real program, supervisor and worker processes) over
//! the real server, four reader threads holding files open (one reading through `mmap`) while the worker
//! is killed with SIGKILL ten times in a row; the server restarting meanwhile; an upgrade under load; a
//! read in flight at the kill (re-sent by the kernel, or with `resend=off` failed at once, not hung); and
//! the supervisor itself killed (the mount is gone, and a new mount cleans it up). Every byte read is
//! checked against the server's manifest (size and CRC32C); no reader may see an error.

use crate::common::{self, fixture, runtime, serve, ServeWith};
use batchfs::api::{self, Manifest};
use batchfs::crc;
use batchfs::index::SourceFormat;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The `batchfs` program under test.
pub(crate) fn program() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_batchfs-e2e-mount"))
}

/// A supervised mount started as a user starts it (`batchfs mount ... --foreground`); its supervisor is
/// stopped and the mountpoint detached on drop, also when a test panics.
pub(crate) struct Supervised {
    _dir: tempfile::TempDir,
    pub(crate) mountpoint: PathBuf,
    supervisor: Child,
    log: PathBuf,
}

impl Supervised {
    pub(crate) fn start(program: &Path, url: &str, options: &str) -> Supervised {
        let dir = tempfile::tempdir().unwrap();
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&mountpoint).unwrap();
        Supervised::start_at(dir, mountpoint, program, url, options)
    }

    fn start_at(dir: tempfile::TempDir, mountpoint: PathBuf, program: &Path, url: &str, options: &str) -> Self {
        Supervised::start_limited(dir, mountpoint, program, url, options, None)
    }

    /// [`Supervised::start_at`], with the mount's limit of open files (soft and hard) `open_files`.
    fn start_limited(
        dir: tempfile::TempDir,
        mountpoint: PathBuf,
        program: &Path,
        url: &str,
        options: &str,
        open_files: Option<u64>,
    ) -> Self {
        use std::os::unix::process::CommandExt;
        let log = dir.path().join(format!("mount-{}.log", Instant::now().elapsed().as_nanos()));
        let mut command = Command::new(program);
        command
            .args(["mount", url])
            .arg(&mountpoint)
            .args(["-o", options, "--foreground"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if let Some(n) = open_files {
            // SAFETY: between fork and exec the closure makes one async-signal-safe call (setrlimit) on a
            // struct of its own.
            unsafe {
                command.pre_exec(move || {
                    let limit = libc::rlimit { rlim_cur: n, rlim_max: n };
                    match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                        0 => Ok(()),
                        _ => Err(std::io::Error::last_os_error()),
                    }
                });
            }
        }
        let supervisor = command.spawn().unwrap();
        let m = Supervised { _dir: dir, mountpoint, supervisor, log };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::fs::read(m.mountpoint.join(".batchfs/stats")).is_err() {
            assert!(Instant::now() < deadline, "the mount never came up:\n{}", m.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        m
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub(crate) fn stats(&self) -> serde_json::Value {
        common::mount_stats(&self.mountpoint)
    }

    fn worker(&self) -> u32 {
        self.stats()["worker_pid"].as_u64().unwrap() as u32
    }

    /// The workers that served the mount, in order, as the supervisor logged them, each with the time
    /// without service of its takeover (none for the first). Read from the log, not through the mount:
    /// while the server is down, every FUSE thread may be waiting out reads, and the stats file with them.
    fn served(&self) -> Vec<(i32, Option<Duration>)> {
        let mut text = self.log_text();
        // The log's colours: escape, '[', digits and ';', 'm'.
        while let Some(at) = text.find('\u{1b}') {
            let end = text[at..].find('m').map_or(text.len(), |m| at + m + 1);
            text.replace_range(at..end, "");
        }
        let field = |line: &str, key: &str| -> Option<f64> {
            let rest = &line[line.find(&format!("{key}="))? + key.len() + 1..];
            rest.split(|c: char| !(c.is_ascii_digit() || c == '.')).next()?.parse().ok()
        };
        text.lines()
            .filter(|l| {
                l.contains("the worker serves the mount") || l.contains("takeover: a new worker serves the mount")
            })
            .map(|l| (field(l, "pid").unwrap() as i32, field(l, "ms").map(|ms| Duration::from_secs_f64(ms / 1e3))))
            .collect()
    }

    /// The first worker's pid, once the supervisor has logged that it serves (within 20 s).
    fn first_served(&self) -> i32 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(&(pid, _)) = self.served().first() {
                return pid;
            }
            assert!(Instant::now() < deadline, "the worker never served:\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills the worker with SIGKILL and waits until its successor serves: the time without service the
    /// supervisor measured for the takeover.
    pub(crate) fn kill_worker(&self) -> Duration {
        let before = self.served();
        let &(pid, _) = before.last().expect("a worker serves");
        assert_ne!(pid as u32, self.supervisor.id(), "the worker is a process of its own");
        // SAFETY: kill has no memory-safety preconditions.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(&(_, Some(took))) = self.served().get(before.len()) {
                return took;
            }
            assert!(Instant::now() < deadline, "no takeover {} within 30 s:\n{}", before.len(), self.log_text());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        if let Ok(None) = self.supervisor.try_wait() {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(self.supervisor.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.supervisor.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.supervisor.kill();
        let _ = self.supervisor.wait();
        drop(batchfs_mount::plan::UnmountOnDrop(self.mountpoint.clone()));
    }
}

pub(crate) fn manifest(rt: &tokio::runtime::Runtime, base: &str, epoch: u64, query: &str) -> Manifest {
    let url = format!("{base}{}?{query}", api::manifest_path("d", epoch));
    let client = common::h2c();
    rt.block_on(async { client.get(url).send().await.unwrap().json().await.unwrap() })
}

/// Four readers over `epochs` of the mount until `stop`: three read each file in 64 KiB pieces with a
/// pause between pieces (so files are open across the kills), one maps each file and reads it through
/// the mapping. Every file is checked whole; the number of files read is returned. Any error fails.
/// Tells [`readers`] to stop when dropped: at the end of the scope that runs them, and when that scope's
/// body panics too (an assertion failed), so the scope ends and the test fails instead of waiting for
/// ever on readers that go on reading.
pub(crate) struct StopReaders<'a>(pub &'a AtomicBool);

impl Drop for StopReaders<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

pub(crate) fn readers(root: &Path, manifests: &[Manifest], stop: &AtomicBool, read: &AtomicU64) {
    std::thread::scope(|s| {
        for r in 0..4 {
            s.spawn(move || {
                let mut pass = 0;
                while !stop.load(Ordering::Relaxed) || pass == 0 {
                    let m = &manifests[pass % manifests.len()];
                    let epoch = root.join(format!("epoch-{:04}", m.epoch));
                    for entry in m.batches.iter().skip(r).step_by(4) {
                        let path = epoch.join(format!("batch-{:06}.tfrecord", entry.index));
                        let fail = |e: std::io::Error| -> ! { panic!("reader {r}: {}: {e}", path.display()) };
                        let mut file = std::fs::File::open(&path).unwrap_or_else(|e| fail(e));
                        let body = if r == 3 {
                            let body = common::map_file(&file);
                            std::thread::sleep(Duration::from_millis(2));
                            body
                        } else {
                            let mut body = Vec::new();
                            let mut piece = vec![0u8; 64 << 10];
                            loop {
                                let n = file.read(&mut piece).unwrap_or_else(|e| fail(e));
                                if n == 0 {
                                    break;
                                }
                                body.extend_from_slice(&piece[..n]);
                                std::thread::sleep(Duration::from_micros(500));
                            }
                            body
                        };
                        assert_eq!(body.len() as u64, entry.bytes, "reader {r}: {}", path.display());
                        assert_eq!(crc::crc32c(&body), entry.crc32c, "reader {r}: {}: a wrong byte", path.display());
                        read.fetch_add(1, Ordering::Relaxed);
                    }
                    pass += 1;
                }
            });
        }
    });
}

/// Whether process `pid` is gone (or a zombie: nothing left of it but its exit status).
pub(crate) fn gone(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| s.contains(") Z "))
}

fn median(mut d: Vec<Duration>) -> Duration {
    d.sort();
    d[d.len() / 2]
}

/// Ten SIGKILLs of the worker, 300 ms apart, under four readers; with `restart_server`, the server is
/// also shut down and started again on its address meanwhile.
fn killed_ten_times(options: &str, restart_server: bool) {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 2_000, 30_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let addr = server.running.local_addr();
    let query = "batch_size=16";
    let manifests: Vec<Manifest> = (0..2).map(|e| manifest(&rt, &server.base, e, query)).collect();
    let url = format!("{}/d", server.base);
    // Each worker is killed 300 ms after it serves: a takeover (worker_settle=100ms), not a worker that
    // does not come up (by default, one that dies within 10 s of serving: given up after five in a row).
    let m = Supervised::start(&program(), &url, &format!("batch_size=16,worker_settle=100ms,{options}"));
    let first = m.worker();
    // One file open and mapped through every takeover: with passthrough its backing file belongs to the
    // connection, not to the worker that registered it.
    let entry = manifests[1].batches[3];
    let held = std::fs::File::open(m.mountpoint.join(format!("epoch-0001/batch-{:06}.tfrecord", entry.index))).unwrap();
    let map = batchfs::mmap::MappedFile::open_file(&held).unwrap();
    assert_eq!(crc::crc32c(map.bytes()), entry.crc32c);
    let (stop, read) = (AtomicBool::new(false), AtomicU64::new(0));
    let mut server = Some(server);
    let mut restarted = None;
    let took: Vec<Duration> = std::thread::scope(|s| {
        s.spawn(|| readers(&m.mountpoint, &manifests, &stop, &read));
        let _stop = StopReaders(&stop);
        (0..10)
            .map(|i| {
                std::thread::sleep(Duration::from_millis(300));
                if restart_server && i == 4 {
                    rt.block_on(server.take().unwrap().running.shutdown());
                }
                let took = m.kill_worker();
                if restart_server && i == 5 {
                    restarted = Some(rt.block_on(common::serve_on(addr, &[("d", &fx.path)])));
                }
                took
            })
            .collect()
    });
    let s = m.stats();
    assert_eq!(s["worker_restarts"].as_u64(), Some(10), "{s}");
    assert_eq!(crc::crc32c(map.bytes()), entry.crc32c, "the mapping made before the kills");
    let mut again = Vec::new();
    (&held).read_to_end(&mut again).unwrap();
    assert_eq!(crc::crc32c(&again), entry.crc32c, "the handle opened before the kills");
    drop((map, held));
    assert_ne!(s["worker_pid"].as_u64(), Some(first.into()));
    assert!(read.load(Ordering::Relaxed) > 0);
    eprintln!(
        "{options} restart_server={restart_server}: {} files read whole; without service per takeover: median {:?}, \
         worst {:?}",
        read.load(Ordering::Relaxed),
        median(took.clone()),
        took.iter().max().unwrap()
    );
    drop(restarted);
}

/// A mount whose limit of open files is a login's default, 1,024 soft and hard, serves a tree of more
/// small files than that, every byte right, by passthrough until its memory files would leave too few
/// descriptors free and through the daemon past that. Before, each cached file held a memory file's
/// descriptor until none was left: the 1,005th file's fetch failed ("no memory file for the body: Too
/// many open files") and every open from then on answered EIO after `timeout`.
#[test]
fn a_mount_with_a_login_s_limit_of_open_files_reads_more_small_files_than_that() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Files, 3000, 1000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let dir = tempfile::tempdir().unwrap();
    let mountpoint = dir.path().join("mnt");
    std::fs::create_dir(&mountpoint).unwrap();
    let url = format!("{}/d", server.base);
    let m = Supervised::start_limited(dir, mountpoint, &program(), &url, "timeout=10s", Some(1024));
    let want = crate::raw::tree(&fx.path);
    assert!(want.len() > 2000, "{} files", want.len());
    for (path, bytes) in &want {
        let got = std::fs::read(m.mountpoint.join("raw").join(path));
        assert!(got.as_ref().is_ok_and(|got| got == bytes), "raw/{path}: {:?}\n{}", got.err(), m.log_text());
    }
    let stats = m.stats();
    assert_eq!(stats["errors"], 0, "{stats}");
    assert!(stats["passthrough_opens"].as_u64().unwrap() > 0, "passthrough while descriptors last: {stats}");
    assert!(stats["daemon_opens"].as_u64().unwrap() > 0, "through the daemon past them: {stats}");
    assert!(m.log_text().contains("short of file descriptors"), "{}", m.log_text());
}

/// A supervised mount of `server`'s dataset `d` whose worker cannot be replaced (its `cache_dir` turned
/// into a file), with `timeout`: its worker killed once the supervisor has it serving (a worker killed
/// before it said so fails the mount itself). The cache's folder, the `cache_dir` path, and the mount.
fn without_a_worker(server: &common::Server, timeout: &str) -> (tempfile::TempDir, PathBuf, Supervised) {
    let cache = tempfile::tempdir().unwrap();
    let cache_dir = cache.path().join("cache");
    std::fs::create_dir(&cache_dir).unwrap();
    let url = format!("{}/d", server.base);
    let options = format!("batch_size=8,cache_dir={},timeout={timeout}", cache_dir.display());
    let m = Supervised::start(&program(), &url, &options);
    std::fs::remove_dir_all(&cache_dir).unwrap();
    std::fs::write(&cache_dir, b"not a directory").unwrap();
    let pid = m.first_served();
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    (cache, cache_dir, m)
}

/// A mount whose worker cannot be replaced (its `cache_dir` turned into a file meanwhile) answers its
/// readers EIO once it has been without one for `timeout`, as for an unreachable server, and serves again
/// once a worker can start. Before, every request waited for good while the supervisor tried again each
/// second.
#[test]
fn reads_fail_after_timeout_while_no_worker_can_start_and_work_once_one_can() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 2000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_cache, cache_dir, m) = without_a_worker(&server, "3s");
    let batch = m.mountpoint.join("epoch-0000/batch-000000.tfrecord");
    // In a thread of its own: a read that never ends fails the test (the supervisor stopped on drop ends
    // it) instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    let reading = batch.clone();
    std::thread::spawn(move || tx.send(std::fs::read(reading)));
    let got = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| panic!("no answer:\n{}", m.log_text()));
    let err = got.expect_err("no worker serves");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}\n{}", m.log_text());
    // The supervisor logs it once its answers are written: a moment after the reader has its EIO.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !m.log_text().contains("its waiting requests answered EIO") {
        assert!(Instant::now() < deadline, "{}", m.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }

    std::fs::remove_file(&cache_dir).unwrap();
    std::fs::create_dir(&cache_dir).unwrap();
    let want = manifest(&rt, &server.base, 0, "batch_size=8").batches[0].crc32c;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match std::fs::read(&batch) {
            Ok(bytes) => break assert_eq!(crc::crc32c(&bytes), want),
            Err(e) => assert!(Instant::now() < deadline, "no worker again: {e}\n{}", m.log_text()),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(m);
    rt.block_on(server.running.shutdown());
}

/// A mount whose worker cannot be replaced (its `cache_dir` turned into a file), unmounted lazily: the
/// supervisor exits once `timeout` has passed without a worker. It went on starting workers (one failing
/// every moment) for good, holding the detached connection, for no one.
#[test]
fn a_supervisor_without_a_worker_exits_once_its_mount_is_unmounted() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 2000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_cache, _, mut m) = without_a_worker(&server, "2s");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !m.log_text().contains("no worker serves the mount: trying again") {
        assert!(Instant::now() < deadline, "{}", m.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let at = std::ffi::CString::new(m.mountpoint.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: umount2 reads the path, a NUL-terminated string that outlives the call.
    assert_eq!(unsafe { libc::umount2(at.as_ptr(), libc::MNT_DETACH) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = m.supervisor.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the supervisor outlived its mount:\n{}", m.log_text());
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}\n{}", m.log_text());
    assert!(m.log_text().contains("the mount ended while no worker served it"), "{}", m.log_text());
    drop(m);
    rt.block_on(server.running.shutdown());
}

/// The supervisor's exit status, once it has exited (within 60 s: five workers that do not serve take
/// about 15 s of waits).
fn supervisor_exit(m: &mut Supervised) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = m.supervisor.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "the supervisor never gave the mount up:\n{}", m.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A mount whose workers cannot start (its `cache_dir` turned into a file) is given up once five in a row
/// have failed, tried again 1, 2, 4 and 8 s apart: the supervisor unmounts it and exits non-zero, naming
/// the workers' reason. Before, it started a failing worker every second for good.
#[test]
fn a_mount_whose_workers_keep_failing_to_start_is_given_up_and_unmounted() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 2000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let (_cache, _, mut m) = without_a_worker(&server, "60s");
    let killed = Instant::now();
    let status = supervisor_exit(&mut m);
    let (took, log) = (killed.elapsed(), m.log_text());
    assert!(!status.success(), "{status}\n{log}");
    assert!(log.contains("5 workers in a row did not serve the mount at"), "{log}");
    assert!(log.contains("the mount is given up") && log.contains("cannot use cache_dir"), "its reason:\n{log}");
    // Its own exit status, not the SIGKILL the supervisor ended it with; its program by its path.
    assert!(log.contains("(exit status: 1)") && !log.contains("(/proc/self/exe)"), "its status:\n{log}");
    assert_eq!(log.matches("no worker serves the mount: trying again").count(), 4, "{log}");
    assert!(took >= Duration::from_secs(14), "not backed off 1 + 2 + 4 + 8 s: given up after {took:?}\n{log}");
    assert!(!batchfs_mount::plan::is_mountpoint(&m.mountpoint), "unmounted:\n{log}");
    drop(m);
    rt.block_on(server.running.shutdown());
}

/// A worker program (Python) that runs `real` and ends as soon as it has said it serves: it hands `real` a
/// ready socket of its own and passes what `real` says there on to the supervisor, so it ends only once
/// the supervisor has heard `ready`. (A fixed `sleep 0.5` before stopping it, as before, stopped a worker
/// slower than that to start, on a loaded machine, before it served: the supervisor then started the
/// program it runs itself, which served, and the test failed after a minute.) Then it stops `real` and
/// exits 3, or with `killed` kills `real` and itself with SIGKILL, as the OOM killer would.
fn ends_as_it_serves(real: &Path, killed: bool) -> String {
    const SCRIPT: &str = r#"#!/usr/bin/env python3
import os, signal, socket, subprocess, sys
up = os.dup(6)
mine, theirs = socket.socketpair()
os.dup2(theirs.fileno(), 6)
theirs.close()
real = subprocess.Popen([REAL] + sys.argv[1:], pass_fds=(3, 4, 5, 6))
os.close(6)
said = b""
while not said.startswith(b"ready"):
    got = mine.recv(512)
    if not got:
        break
    said += got
os.write(up, said)
if KILLED:
    real.kill()
    real.wait()
    os.kill(os.getpid(), signal.SIGKILL)
real.terminate()
real.wait()
sys.exit(3)
"#;
    let real = format!("{:?}", real.to_str().unwrap());
    SCRIPT.replace("REAL", &real).replace("KILLED", if killed { "True" } else { "False" })
}

/// A copy of the program under test at `bin/batchfs` and `bin/real`, and a mount of `url` by the first.
fn installed_in(bin: &Path, url: &str, options: &str) -> (Supervised, PathBuf) {
    let (installed, real) = (bin.join("batchfs"), bin.join("real"));
    std::fs::copy(program(), &installed).unwrap();
    std::fs::copy(program(), &real).unwrap();
    (Supervised::start(&installed, url, options), real)
}

/// Installs `text` as the program at `bin/batchfs`, which the supervisor starts its next workers from.
fn install(bin: &Path, text: &str) {
    let script = bin.join(".script");
    std::fs::write(&script, text).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::rename(&script, bin.join("batchfs")).unwrap();
}

/// Workers that say they serve and stop by themselves at once (as one does whose FUSE threads a pids limit
/// refuses) are started again 1, 2, 4 and 8 s apart, not in a tight loop, and the fifth in a row gives the
/// mount up, naming its exit status; the first of them, replacing a worker that served for `worker_settle`
/// (3 s here), started at once. Before, they were started again for good, the first three at once. The
/// workers are a script installed at the supervisor's path that runs the program and stops it
/// ([`ends_as_it_serves`]).
#[test]
fn workers_that_stop_as_soon_as_they_serve_are_started_again_later_and_then_given_up() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 2000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let bin = tempfile::tempdir().unwrap();
    let settle = Duration::from_secs(3);
    let (mut m, real) = installed_in(bin.path(), &format!("{}/d", server.base), "batch_size=8,worker_settle=3s");
    install(bin.path(), &ends_as_it_serves(&real, false));
    // Served for `worker_settle` at the kill: the supervisor counts from before it logs that it serves.
    m.first_served();
    std::thread::sleep(settle + Duration::from_millis(200));
    let killed = Instant::now();
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(m.worker() as i32, libc::SIGKILL) }, 0);
    let status = supervisor_exit(&mut m);
    let (took, log) = (killed.elapsed(), m.log_text());
    assert!(!status.success(), "{status}\n{log}");
    assert!(log.contains("5 workers in a row did not serve the mount at"), "{log}");
    assert!(log.contains("after it said it serves (exit status: 3)"), "its exit status:\n{log}");
    let served = m.served();
    assert_eq!(served.len(), 6, "the first worker and five that stopped, no more:\n{log}");
    let first = served[1].1.unwrap();
    assert!(first < Duration::from_secs(1), "the first after a worker that served, at once: {first:?}\n{log}");
    assert!(took >= Duration::from_secs(15), "not backed off 1 + 2 + 4 + 8 s: given up after {took:?}\n{log}");
    assert!(!batchfs_mount::plan::is_mountpoint(&m.mountpoint), "unmounted:\n{log}");
    drop(m);
    rt.block_on(server.running.shutdown());
}

/// Workers killed with SIGKILL as soon as they serve, as the OOM killer kills a worker that takes more
/// memory than its cgroup has once it serves, are started again 1, 2, 4 and 8 s apart and the fifth in a
/// row gives the mount up, with the default `worker_settle` (10 s), saying they were killed. Before, a
/// worker killed with SIGKILL was taken for one killed by hand and replaced at once however soon it died:
/// for good, in a tight loop. The first of them follows an upgrade (SIGHUP), which replaces the worker at
/// once.
#[test]
fn workers_killed_as_soon_as_they_serve_are_started_again_later_and_then_given_up() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 2000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let bin = tempfile::tempdir().unwrap();
    let (mut m, real) = installed_in(bin.path(), &format!("{}/d", server.base), "batch_size=8");
    install(bin.path(), &ends_as_it_serves(&real, true));
    let upgraded = Instant::now();
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(m.supervisor.id() as i32, libc::SIGHUP) }, 0);
    let status = supervisor_exit(&mut m);
    let (took, log) = (upgraded.elapsed(), m.log_text());
    assert!(!status.success(), "{status}\n{log}");
    assert!(log.contains("5 workers in a row did not serve the mount at"), "{log}");
    assert!(log.contains("it was killed (SIGKILL: the OOM killer?)"), "its end:\n{log}");
    assert_eq!(log.matches("no worker serves the mount: trying again").count(), 4, "{log}");
    assert_eq!(m.served().len(), 6, "the first worker and five killed, no more:\n{log}");
    assert!(took >= Duration::from_secs(15), "not backed off 1 + 2 + 4 + 8 s: given up after {took:?}\n{log}");
    assert!(!batchfs_mount::plan::is_mountpoint(&m.mountpoint), "unmounted:\n{log}");
    drop(m);
    rt.block_on(server.running.shutdown());
}

/// The mount's first worker killed before it says it serves (a window of a moment at mount time, in which
/// it may already answer requests) is replaced, as a later one is: the mount comes up. It failed the mount
/// before ("the worker did not serve the mount"). The worker is started from the program installed at the
/// supervisor's path, so a script put there while the supervisor checks the server (slowed by a link of
/// 250 ms each way) is the first worker: it kills itself the first time, and runs the program after.
#[test]
fn a_first_worker_killed_before_it_serves_is_replaced_and_the_mount_comes_up() {
    use batchfs_lab::netem::{start, Link};
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 2000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let link = Link {
        one_way: Duration::from_millis(250),
        jitter: Duration::ZERO,
        rate: None,
        queue: batchfs_lab::netem::QUEUE,
    };
    let netem = start("127.0.0.1:0".parse().unwrap(), server.running.local_addr(), link).unwrap();
    let bin = tempfile::tempdir().unwrap();
    let (installed, real, killed) = (bin.path().join("batchfs"), bin.path().join("real"), bin.path().join("killed"));
    std::fs::copy(program(), &installed).unwrap();
    std::fs::copy(program(), &real).unwrap();
    let script = bin.path().join(".script");
    let text = format!(
        "#!/bin/sh\nif [ ! -e {k} ]; then touch {k}; kill -9 $$; fi\nexec {r} \"$@\"\n",
        k = killed.display(),
        r = real.display()
    );
    std::fs::write(&script, text).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let swap = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        std::fs::rename(&script, &installed).unwrap();
    });
    let m = Supervised::start(&bin.path().join("batchfs"), &format!("http://{}/d", netem.addr), "batch_size=8");
    swap.join().unwrap();
    assert!(killed.exists(), "the first worker ran the script:\n{}", m.log_text());
    assert!(m.log_text().contains("the first worker was killed before it served"), "{}", m.log_text());
    let want = manifest(&rt, &server.base, 0, "batch_size=8").batches[0].crc32c;
    let batch = std::fs::read(m.mountpoint.join("epoch-0000/batch-000000.tfrecord")).unwrap();
    assert_eq!(crc::crc32c(&batch), want);
    let exe = std::fs::read_link(format!("/proc/{}/exe", m.worker())).unwrap();
    assert_eq!(exe, real, "the second worker serves");
    drop(m);
    rt.block_on(server.running.shutdown());
}

#[test]
fn a_worker_killed_ten_times_mid_epoch_is_replaced_and_every_read_completes() {
    killed_ten_times("passthrough=true", false);
}

#[test]
fn through_the_daemon_a_worker_killed_ten_times_is_replaced_and_every_read_completes() {
    killed_ten_times("passthrough=false", false);
}

#[test]
fn the_worker_killed_while_the_server_restarts_is_replaced_and_every_read_completes() {
    killed_ten_times("passthrough=true", true);
}

/// `batchfs mount --upgrade` under load: the program at the path the mount was started from is replaced
/// by a new file, and the supervisor's new worker runs it; no reader sees an error.
#[test]
fn an_upgrade_under_load_replaces_the_worker_by_the_installed_program() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 1_500, 30_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let manifests: Vec<Manifest> = (0..2).map(|e| manifest(&rt, &server.base, e, "batch_size=16")).collect();
    let bin = tempfile::tempdir().unwrap();
    let installed = bin.path().join("batchfs");
    std::fs::copy(program(), &installed).unwrap();
    let m = Supervised::start(&installed, &format!("{}/d", server.base), "batch_size=16");
    let old = m.worker();
    let (stop, read) = (AtomicBool::new(false), AtomicU64::new(0));
    std::thread::scope(|s| {
        s.spawn(|| readers(&m.mountpoint, &manifests, &stop, &read));
        let _stop = StopReaders(&stop);
        std::thread::sleep(Duration::from_millis(500));
        // A package upgrade: the new program is written beside and renamed over the old one.
        let staged = bin.path().join(".batchfs.new");
        std::fs::copy(program(), &staged).unwrap();
        std::fs::rename(&staged, &installed).unwrap();
        let out = Command::new(&installed).args(["mount", "--upgrade"]).arg(&m.mountpoint).output().unwrap();
        assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), m.log_text());
        assert!(String::from_utf8_lossy(&out.stdout).contains("upgraded"), "{out:?}");
        std::thread::sleep(Duration::from_millis(500));
    });
    let new = m.worker();
    assert_ne!(new, old);
    let exe = std::fs::read_link(format!("/proc/{new}/exe")).unwrap();
    assert_eq!(exe, installed, "the new worker runs the program installed now, not the replaced one");
    let exe = std::fs::read_link(format!("/proc/{}/exe", m.supervisor.id())).unwrap();
    assert!(exe.to_string_lossy().ends_with("(deleted)"), "the supervisor still runs the old one: {exe:?}");
    assert!(m.log_text().contains("upgrade: replacing the worker"), "{}", m.log_text());

    // An install that cannot serve (a program that fails at once): the supervisor starts the one it runs
    // instead, the mount goes on, and the upgrade says it failed (it said "upgraded" before).
    let staged = bin.path().join(".batchfs.broken");
    std::fs::write(&staged, "#!/bin/sh\nexit 1\n").unwrap();
    std::fs::set_permissions(&staged, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::rename(&staged, &installed).unwrap();
    let out = Command::new(program()).args(["mount", "--upgrade"]).arg(&m.mountpoint).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("the program installed now cannot serve"), "{out:?}");
    let batch = m.mountpoint.join("epoch-0000/batch-000000.tfrecord");
    assert_eq!(crc::crc32c(&std::fs::read(batch).unwrap()), manifests[0].batches[0].crc32c, "still served");
}

/// An upgrade whose installed program cannot serve, the program the mount was started from renamed aside
/// (not replaced: its path does not end in "(deleted)"): the supervisor starts the one it runs, and the
/// upgrade says it failed (it said "upgraded").
#[test]
fn an_upgrade_to_a_program_that_cannot_serve_fails_whatever_became_of_the_old_one() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 2000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let bin = tempfile::tempdir().unwrap();
    let installed = bin.path().join("batchfs");
    std::fs::copy(program(), &installed).unwrap();
    let m = Supervised::start(&installed, &format!("{}/d", server.base), "batch_size=8");
    let old = m.worker();
    std::fs::rename(&installed, bin.path().join("batchfs.good")).unwrap();
    std::fs::write(&installed, "#!/bin/sh\nexit 3\n").unwrap();
    std::fs::set_permissions(&installed, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = Command::new(program()).args(["mount", "--upgrade"]).arg(&m.mountpoint).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("the program installed now cannot serve"), "{out:?}");
    assert_ne!(m.worker(), old, "replaced, by the supervisor's own program");
    let want = manifest(&rt, &server.base, 0, "batch_size=8").batches[0].crc32c;
    let batch = std::fs::read(m.mountpoint.join("epoch-0000/batch-000000.tfrecord")).unwrap();
    assert_eq!(crc::crc32c(&batch), want, "still served");
    drop(m);
    rt.block_on(server.running.shutdown());
}

/// A mount made by a release that took any number of FUSE threads (`threads=5000`, refused for a new
/// mount since), upgraded: the new release's worker, started with the mount's command line, lowers it to
/// 1024 with a warning and serves. It refused the command line before, and the upgrade failed (the
/// supervisor went back to the program it runs). The old release's command line is a script installed at
/// the supervisor's path that runs the program with the option added.
#[test]
fn an_upgrade_of_a_mount_made_with_more_threads_than_taken_now_runs_the_most() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 64, 2000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let bin = tempfile::tempdir().unwrap();
    let (installed, real) = (bin.path().join("batchfs"), bin.path().join("real"));
    std::fs::copy(program(), &installed).unwrap();
    std::fs::copy(program(), &real).unwrap();
    let m = Supervised::start(&installed, &format!("{}/d", server.base), "batch_size=8");
    let old = m.worker();
    let script = bin.path().join(".script");
    std::fs::write(&script, format!("#!/bin/sh\nexec {} \"$@\" -o threads=5000\n", real.display())).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::rename(&script, &installed).unwrap();
    let out = Command::new(program()).args(["mount", "--upgrade"]).arg(&m.mountpoint).output().unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), m.log_text());
    let new = m.worker();
    assert_ne!(new, old);
    assert_eq!(std::fs::read_link(format!("/proc/{new}/exe")).unwrap(), real, "the new release serves");
    assert!(m.log_text().contains("this mount was made with threads=5000"), "{}", m.log_text());
    let threads = std::fs::read_dir(format!("/proc/{new}/task")).unwrap().count();
    assert!(threads < 1100, "{threads} threads: 1024 FUSE threads and a few more");
    let want = manifest(&rt, &server.base, 0, "batch_size=8").batches[0].crc32c;
    let batch = std::fs::read(m.mountpoint.join("epoch-0000/batch-000000.tfrecord")).unwrap();
    assert_eq!(crc::crc32c(&batch), want);
    drop(m);
    rt.block_on(server.running.shutdown());
}

/// A read in flight when the worker dies: the kernel re-sends it to the next worker, which answers it
/// once the server is back; with `resend=false` it fails at once with ECONNABORTED (no hang), and the
/// mount goes on serving.
#[test]
fn a_read_in_flight_at_the_kill_is_resent_or_with_resend_off_fails_at_once() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 600, 30_000);
    let mut server = Some(rt.block_on(serve(&[("d", &fx.path)], ServeWith::default())));
    let addr = server.as_ref().unwrap().running.local_addr();
    let base = server.as_ref().unwrap().base.clone();
    let m0 = manifest(&rt, &base, 0, "batch_size=16");
    let entry = m0.batches[5];
    let url = format!("{base}/d");
    for resend in [true, false] {
        let m = Supervised::start(&program(), &url, &format!("batch_size=16,resend={resend}"));
        let path = m.mountpoint.join("epoch-0000").join(format!("batch-{:06}.tfrecord", entry.index));
        // The server goes away: the read waits in the worker for it.
        rt.block_on(server.take().unwrap().running.shutdown());
        let reader = std::thread::spawn({
            let path = path.clone();
            move || {
                let started = Instant::now();
                (std::fs::read(&path), started)
            }
        });
        std::thread::sleep(Duration::from_millis(700));
        assert!(!reader.is_finished(), "the read waits for the server");
        let killed = Instant::now();
        m.kill_worker();
        if resend {
            std::thread::sleep(Duration::from_millis(500));
            assert!(!reader.is_finished(), "re-sent to the new worker, which waits for the server too");
            server = Some(rt.block_on(common::serve_on(addr, &[("d", &fx.path)])));
            let (body, _) = reader.join().unwrap();
            let body = body.expect("the re-sent read completes");
            assert_eq!(crc::crc32c(&body), entry.crc32c, "the server's bytes");
        } else {
            let (got, _) = reader.join().unwrap();
            let e = got.expect_err("with resend=false the read in flight fails");
            assert_eq!(e.raw_os_error(), Some(libc::ECONNABORTED), "{e}");
            assert!(killed.elapsed() < Duration::from_secs(5), "at once, not at a timeout: {:?}", killed.elapsed());
            server = Some(rt.block_on(common::serve_on(addr, &[("d", &fx.path)])));
            let body = std::fs::read(&path).expect("the next read is served");
            assert_eq!(crc::crc32c(&body), entry.crc32c);
        }
    }
}

/// The supervisor itself killed: the worker goes with it and the mount is gone (ENOTCONN), as a single
/// daemon's is; a new `batchfs mount` on the directory cleans it up and serves.
/// `getxattr(path, "security.selinux")`, as `ls -l` asks.
fn xattr_of(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut value = [0u8; 256];
    // SAFETY: both names are NUL-terminated, and `value` holds the `value.len()` bytes it is given as.
    let r =
        unsafe { libc::getxattr(path.as_ptr(), c"security.selinux".as_ptr(), value.as_mut_ptr().cast(), value.len()) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Python's `open()` asks every file it opens whether it is a terminal (`TCGETS`), and Linux sends FUSE
/// each such ioctl: each is answered ENOTTY, as a local file answers, and none is logged. fuser's default
/// logged a warning for every one: a line in the mount's log for each file a Python loader opened. The
/// xattrs `ls -l` asks for are not supported, and not logged either.
#[test]
fn terminal_queries_and_xattrs_are_answered_as_unsupported_and_not_logged() {
    use std::os::fd::AsRawFd;
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 300, 20_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let m = Supervised::start(&program(), &format!("{}/d", server.base), "batch_size=16");
    let mut asked = 0;
    for entry in std::fs::read_dir(m.mountpoint.join("epoch-0000")).unwrap() {
        let file = std::fs::File::open(entry.unwrap().path()).unwrap();
        let mut termios = std::mem::MaybeUninit::<libc::termios>::uninit();
        // SAFETY: TCGETS writes at most one termios, which `termios` holds.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TCGETS, termios.as_mut_ptr()) };
        assert_eq!((r, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::ENOTTY)));
        asked += 1;
    }
    assert!(asked >= 10, "{asked} files");
    // `ls -l` asks for xattrs: not supported, and not a warning either.
    let batch = m.mountpoint.join("epoch-0000/batch-000000.tfrecord");
    assert!(xattr_of(&batch).is_err_and(|e| e.raw_os_error() == Some(libc::EOPNOTSUPP)));
    assert!(xattr_of(&batch).is_err_and(|e| e.raw_os_error() == Some(libc::EOPNOTSUPP)));
    let log = m.log_text();
    assert!(!log.contains("Not Implemented"), "{log}");
}

#[test]
fn the_supervisor_killed_takes_the_mount_and_a_new_mount_cleans_it_up() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 300, 20_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let entry = manifest(&rt, &server.base, 0, "batch_size=16").batches[0];
    let url = format!("{}/d", server.base);
    let mut m = Supervised::start(&program(), &url, "batch_size=16");
    let worker = m.worker() as i32;
    m.supervisor.kill().unwrap();
    m.supervisor.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gone(worker) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(gone(worker), "the worker goes with its supervisor");
    // A request already queued when the connection went fails with ECONNABORTED; the mount then answers
    // every access with ENOTCONN.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let err = std::fs::read_dir(&m.mountpoint).map(|_| ()).unwrap_err();
        match err.raw_os_error() {
            Some(libc::ENOTCONN) => break,
            Some(libc::ECONNABORTED) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => panic!("the mount's supervisor is gone: {err}"),
        }
    }
    // `m` stays (and detaches the directory last): the new mount finds the stale one there.
    let again =
        Supervised::start_at(tempfile::tempdir().unwrap(), m.mountpoint.clone(), &program(), &url, "batch_size=16");
    let body = std::fs::read(again.mountpoint.join(format!("epoch-0000/batch-{:06}.tfrecord", entry.index))).unwrap();
    assert_eq!(crc::crc32c(&body), entry.crc32c);
    assert!(again.log_text().contains("cleaning up a stale mount"), "{}", again.log_text());
}

/// `batchfs umount`, then at once `batchfs mount` at the same place, as a job script does between two runs:
/// the first mount's process (its supervisor, or, unsupervised, the one serving it), which ends after its
/// mount did, leaves the second mount alone. (Each once unmounted whatever was mounted there when it
/// ended: the supervisor by the path, the session by fuser's check read the wrong way round; a third of
/// supervised mounts were gone a moment after `batchfs mount` had said they were up.)
#[test]
fn a_mount_made_where_the_last_one_was_just_unmounted_outlives_the_last_ones_process() {
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 100, 10_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let url = format!("{}/d", server.base);
    for options in ["", "supervise=false"] {
        let dir = tempfile::tempdir().unwrap();
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&mountpoint).unwrap();
        let start =
            || Supervised::start_at(tempfile::tempdir().unwrap(), mountpoint.clone(), &program(), &url, options);
        // Every mount is dropped last, the mountpoint free by then: a drop detaches whatever is mounted there.
        let mut mounts = vec![start()];
        for round in 0..10 {
            let out = Command::new(program()).arg("umount").arg(&mountpoint).output().unwrap();
            assert!(out.status.success(), "{options:?}, round {round}: {}", String::from_utf8_lossy(&out.stderr));
            mounts.push(start());
            let n = mounts.len();
            let last = &mut mounts[n - 2].supervisor;
            let deadline = Instant::now() + Duration::from_secs(10);
            while last.try_wait().unwrap().is_none() {
                assert!(Instant::now() < deadline, "{options:?}, round {round}: an unmounted mount's process went on");
                std::thread::sleep(Duration::from_millis(20));
            }
            let up = batchfs_mount::plan::is_mountpoint(&mountpoint)
                && std::fs::read(mountpoint.join(".batchfs/stats")).is_ok();
            let logs = format!("{}\nthe last one's:\n{}", mounts[n - 1].log_text(), mounts[n - 2].log_text());
            assert!(up, "{options:?}, round {round}: the new mount is gone:\n{logs}");
        }
        let out = Command::new(program()).arg("umount").arg(&mountpoint).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

/// A datagram from `socket` with the descriptors it carries (`SCM_RIGHTS`), as systemd receives them.
fn receive_with_fds(socket: &std::os::unix::net::UnixDatagram) -> (String, Vec<std::os::fd::OwnedFd>) {
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut data = [0u8; 4096];
    let mut control = [0u64; 16];
    let mut iov = libc::iovec { iov_base: data.as_mut_ptr().cast(), iov_len: data.len() };
    // SAFETY: msghdr is plain data; its buffers (data, control) outlive the recvmsg call, and the control
    // messages are read within the length the kernel reports.
    unsafe {
        let mut msg = std::mem::zeroed::<libc::msghdr>();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        let n = libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        assert!(n >= 0, "{}", std::io::Error::last_os_error());
        let mut fds = Vec::new();
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>().add(i));
                    fds.push(std::os::fd::OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
        (String::from_utf8_lossy(&data[..n as usize]).into_owned(), fds)
    }
}

/// Under systemd (emulated here: its notify socket, and its way of passing stored descriptors back), the
/// supervisor stores the connection and the ledger (`FDSTORE=1`); killed, with its worker, it is started
/// again with them and takes the mount over: a file held open throughout reads on. The unit it is started
/// again by says `threads=5000`, as releases before took it (since refused for a new mount): the kept
/// mount runs 1024, with a warning, where its supervisor refused it, and so would its workers.
#[test]
fn under_systemd_a_restarted_supervisor_takes_over_the_mount_it_stored() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let rt = runtime();
    let fx = fixture(SourceFormat::Tfrecord, 600, 30_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let manifest = manifest(&rt, &server.base, 0, "batch_size=16");
    let url = format!("{}/d", server.base);
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify");
    let socket = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    socket.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mountpoint = dir.path().join("mnt");
    std::fs::create_dir(&mountpoint).unwrap();
    let start = |extra: &dyn Fn(&mut Command)| {
        // As systemd starts a unit: LISTEN_PID is the pid of the program itself (the shell execs it).
        let mut c = Command::new("sh");
        c.args(["-c", "[ -n \"$LISTEN_FDS\" ] && export LISTEN_PID=$$; exec \"$0\" \"$@\""]).arg(program());
        c.args(["mount", &url]).arg(&mountpoint).args(["-o", "batch_size=16", "--foreground"]);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.path().join("log")).unwrap();
        c.env("NOTIFY_SOCKET", &notify).stdout(Stdio::null()).stderr(log);
        extra(&mut c);
        c.spawn().unwrap()
    };
    let mut first = start(&|_| {});
    let mut stored: Vec<(String, std::os::fd::OwnedFd)> = Vec::new();
    loop {
        let (text, mut fds) = receive_with_fds(&socket);
        if text == "READY=1" {
            break;
        }
        if text.starts_with("FDSTORE=1") {
            let name = text.split("FDNAME=").nth(1).unwrap().trim().to_owned();
            assert_eq!(fds.len(), 1, "{text}");
            stored.push((name, fds.remove(0)));
        }
    }
    let names: Vec<&str> = stored.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["batchfs-fuse", "batchfs-ledger", "batchfs-info"]);
    let entry = manifest.batches[2];
    let path = mountpoint.join(format!("epoch-0000/batch-{:06}.tfrecord", entry.index));
    let held = std::fs::File::open(&path).unwrap();
    let worker = common::mount_stats(&mountpoint)["worker_pid"].as_u64().unwrap() as i32;
    first.kill().unwrap();
    first.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gone(worker) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // systemd starts the unit again with what it stored, as descriptors 3, 4, 5.
    let fds: [i32; 3] = std::array::from_fn(|i| stored[i].1.as_raw_fd());
    let mut second = start(&|c: &mut Command| {
        c.args(["-o", "threads=5000"]);
        c.env("LISTEN_FDS", "3").env("LISTEN_FDNAMES", "batchfs-fuse:batchfs-ledger:batchfs-info");
        // SAFETY: between fork and exec: fcntl and dup2 only, on descriptors this process holds open across
        // the spawn.
        unsafe {
            c.pre_exec(move || {
                let mut moved = [0; 3];
                for (m, &fd) in moved.iter_mut().zip(fds.iter()) {
                    *m = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 20);
                }
                for (target, &fd) in (3..).zip(moved.iter()) {
                    libc::dup2(fd, target);
                }
                Ok(())
            });
        }
    });
    drop(stored);
    // Nothing on the mount is touched before the log says a worker serves it (until then a look would
    // wait for one).
    let log = || std::fs::read_to_string(dir.path().join("log")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !log().contains("takeover: a new worker serves the mount") {
        assert!(second.try_wait().unwrap().is_none(), "the restarted supervisor exited:\n{}", log());
        assert!(Instant::now() < deadline, "the restarted supervisor did not take the mount over:\n{}", log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(log().contains("taking over the mount systemd kept"), "{}", log());
    // The supervisor and its worker each say so.
    assert_eq!(log().matches("this mount was made with threads=5000").count(), 2, "{}", log());
    let stats = common::mount_stats(&mountpoint);
    assert_eq!(stats["supervisor_pid"].as_u64(), Some(second.id().into()), "{stats}");
    assert_eq!(stats["worker_restarts"].as_u64(), Some(1), "{stats}");
    let mut body = Vec::new();
    (&held).read_to_end(&mut body).unwrap();
    assert_eq!(crc::crc32c(&body), entry.crc32c, "a file held open through the supervisor's restart");
    let other = manifest.batches[7];
    let body = std::fs::read(mountpoint.join(format!("epoch-0000/batch-{:06}.tfrecord", other.index))).unwrap();
    assert_eq!(crc::crc32c(&body), other.crc32c);
    drop(held);
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(second.id() as i32, libc::SIGTERM) };
    second.wait().unwrap();
    assert!(!batchfs_mount::plan::is_mountpoint(&mountpoint), "SIGTERM unmounts");
    // And drops what it stored: a unit started again mounts anew, not a connection that is gone. (What
    // came before its READY=1 is its own storing, each name removed first and stored again.)
    let (mut ready, mut removed) = (false, Vec::new());
    while removed.len() < 3 {
        let (text, _) = receive_with_fds(&socket);
        ready |= text == "READY=1";
        if let Some(name) = text.strip_prefix("FDSTOREREMOVE=1\nFDNAME=").filter(|_| ready) {
            removed.push(name.trim().to_owned());
        }
    }
    assert_eq!(removed, ["batchfs-fuse", "batchfs-ledger", "batchfs-info"]);
}
