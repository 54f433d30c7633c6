//! The `batchfs-lab` binary: `energy` around a command, `bench` through a real mount (direct and behind
//! `netem`), `bench --mmap`, and `demo`, the README's first command. Mounts use the `batchfs` binary,
//! built here when missing.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const LAB: &str = env!("CARGO_BIN_EXE_batchfs-lab");

/// The workspace's other binaries (`batchfs`, `batchfs-server`), beside this one, built once when a test
/// first needs them (`cargo test -p batchfs-lab` alone builds only its own).
fn built(bin: &str) -> PathBuf {
    static BUILT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap();
    if !built.iter().any(|b| b == bin) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let package = if bin == "batchfs" { "batchfs-mount" } else { bin };
        let status = Command::new(cargo).args(["build", "-q", "-p", package, "--bin", bin]).status();
        assert!(status.unwrap().success(), "cannot build {bin}");
        built.push(bin.to_owned());
    }
    Path::new(LAB).with_file_name(bin)
}

type Server = batchfs_server::testing::GeneratedServer;

fn server(samples: u32, mean_bytes: u64, token: Option<&str>) -> Server {
    batchfs_server::testing::serve_generated(samples, mean_bytes, token)
}

/// Unmounts (lazily) on drop, so a failing test leaves nothing mounted.
use batchfs_mount::plan::UnmountOnDrop as MountGuard;

fn batchfs(args: &[&str]) -> Output {
    Command::new(built("batchfs")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn lab(args: &[&str]) -> Output {
    Command::new(LAB).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn is_mounted(path: &Path) -> bool {
    batchfs_mount::plan::is_mountpoint(path)
}

#[test]
fn energy_runs_a_command_and_says_which_sensors_are_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("energy.jsonl");
    let out = lab(&[
        "energy",
        "--idle",
        "0s",
        "--interval",
        "100ms",
        "--out",
        out_file.to_str().unwrap(),
        "--",
        "sleep",
        "1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("`sleep 1` exited 0"), "{text}");
    assert!(text.contains("CPU seconds: 0.") && text.contains("perf task-clock"), "{text}");
    // A table of the sensors this machine has, or, where it has none, the statement that there is none,
    // each one it lacks with its reason: never a made-up number.
    let (sensors, unavailable) = batchfs_energy::detect(std::path::Path::new("/"), true, batchfs_energy::PROBE);
    if sensors.is_empty() {
        assert!(text.contains("no energy sensor available") && !text.contains("total J"), "{text}");
    } else {
        assert!(text.contains("total J") && sensors.iter().all(|s| text.contains(s.name())), "{text}");
    }
    assert!(unavailable.iter().all(|u| text.contains(&u.sensor)), "{text}");
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&out_file).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines.len() >= 8, "about 10 samples and a summary: {}", lines.len());
    let summary = &lines.last().unwrap()["summary"];
    assert!(summary["duration_s"].as_f64().unwrap() >= 0.9, "{summary}");
    for u in summary["unavailable"].as_array().unwrap() {
        assert!(!u["reason"].as_str().unwrap().is_empty(), "{u}");
    }
    if summary["sensors"].as_array().unwrap().is_empty() {
        assert!(text.contains("unavailable:"), "with no sensor, the reasons must be printed: {text}");
    }
    // The command's exit status is passed through.
    let failing = lab(&["energy", "--idle", "0s", "--", "sh", "-c", "exit 3"]);
    assert_eq!(failing.status.code(), Some(3));
}

fn bench_json(path: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["bench", path.to_str().unwrap(), "--threads", "2", "--json"];
    args.extend_from_slice(extra);
    let out = lab(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The latency lab's machinery end to end, small: batchfs direct, local copies of its files, and batchfs behind
/// `batchfs-lab netem` at 30 ms, read by `batchfs-lab bench`, paced and unpaced. Checks that it works, not speed.
#[test]
fn latency_lab_machinery_works_end_to_end() {
    let server = server(64, 8000, None);
    let upstream = server.url.trim_start_matches("http://").trim_end_matches("/d").to_owned();
    let netem_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut netem = Command::new(LAB)
        .args(["netem", "--listen", &format!("127.0.0.1:{netem_port}"), "--upstream", &upstream, "--rtt-ms", "30"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _netem = Kill(&mut netem);
    let dir = tempfile::tempdir().unwrap();
    let mnt = std::fs::canonicalize(dir.path()).unwrap().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let _guard = MountGuard(mnt.clone());
    let mut walls = Vec::new();
    let mut bytes = Vec::new();
    for url in [server.url.clone(), format!("http://127.0.0.1:{netem_port}/d")] {
        let started = Instant::now();
        let out = loop {
            let out = batchfs(&["mount", &url, mnt.to_str().unwrap(), "-o", "batch_size=8"]);
            if out.status.success() || started.elapsed() > Duration::from_secs(10) {
                break out;
            }
            std::thread::sleep(Duration::from_millis(100)); // the proxy may still be starting
        };
        assert!(out.status.success(), "{}", stderr(&out));
        let epoch = mnt.join("epoch-0000");
        // Reader threads unpaced, reader processes paced (as DataLoader workers are).
        for extra in [&[][..], &["--consume-mbps", "50", "--processes"][..]] {
            let r = bench_json(&epoch, extra);
            bytes.push(r["bytes"].as_u64().unwrap());
            walls.push(r["wall_s"].as_f64().unwrap());
            assert!(r["read_p99_us"].as_f64().unwrap() >= r["read_p50_us"].as_f64().unwrap());
            assert_eq!(r["processes"].as_bool(), Some(!extra.is_empty()));
            assert_eq!(r["files"].as_u64(), Some(8), "64 samples in batches of 8");
            assert!(r["machine_cpu_s"].as_f64().is_some_and(|c| c >= 0.0), "{r}");
        }
        if walls.len() == 2 {
            // Local disk: the same batch files copied out of the mount.
            let local = dir.path().join("local");
            std::fs::create_dir(&local).unwrap();
            for e in std::fs::read_dir(&epoch).unwrap() {
                let e = e.unwrap();
                std::fs::copy(e.path(), local.join(e.file_name())).unwrap();
            }
            for extra in [&[][..], &["--consume-mbps", "50", "--processes"][..]] {
                let r = bench_json(&local, extra);
                bytes.push(r["bytes"].as_u64().unwrap());
                walls.push(r["wall_s"].as_f64().unwrap());
            }
        }
        assert!(batchfs(&["umount", mnt.to_str().unwrap()]).status.success());
    }
    // The same bytes through every path; the paced runs take at least bytes / rate.
    assert!(bytes.iter().all(|&b| b == bytes[0] && b > 0), "{bytes:?}");
    assert_eq!(bytes.len(), 6);
    for paced in [1, 3, 5] {
        assert!(walls[paced] >= bytes[paced] as f64 / 50e6 * 0.9, "{walls:?}");
    }
}

/// `bench --mmap` reads every page through the mount: the daemon serves the files' bytes (with
/// passthrough off, every read reaches it). A copy out of the mapping that the optimizer dropped would
/// leave `bytes_served` at 0.
#[test]
fn bench_mmap_really_reads_the_pages() {
    let server = server(64, 8000, None);
    let dir = tempfile::tempdir().unwrap();
    let mnt = std::fs::canonicalize(dir.path()).unwrap();
    let out = batchfs(&["mount", &server.url, mnt.to_str().unwrap(), "-o", "batch_size=8,passthrough=false"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let _guard = MountGuard(mnt.clone());
    let epoch = mnt.join("epoch-0000");
    let r = bench_json(&epoch, &["--mmap", "--pattern", "sequential"]);
    let stats: serde_json::Value =
        serde_json::from_slice(&batchfs(&["stats", "--json", mnt.to_str().unwrap()]).stdout).unwrap();
    assert_eq!(stats["passthrough"], false);
    assert_eq!(r["bytes"], stats["bytes_served"], "every byte of every file came from the daemon: {r} {stats}");
    // The bytes read are the batch files' bytes (bench skips the .idx twins, as loaders read them apart).
    let (mut bytes, mut sum) = (0, 0u64);
    for e in std::fs::read_dir(&epoch).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "idx") {
            continue;
        }
        let data = std::fs::read(path).unwrap();
        bytes += data.len() as u64;
        sum = sum.wrapping_add(batchfs_lab::bench::byte_sum(&data));
    }
    assert_eq!((r["bytes"].as_u64(), r["byte_sum"].as_u64()), (Some(bytes), Some(sum)), "{r}");
    assert!(batchfs(&["umount", mnt.to_str().unwrap()]).status.success());
}

/// The README's first command: `batchfs-lab demo` starts the real server binary, mounts, reads an epoch with
/// four readers, checks every file and unmounts.
#[test]
fn demo_reads_every_batch_file_through_a_mount_and_cleans_up() {
    // The demo runs the batchfs-server binary found beside its own.
    built("batchfs-server");
    let out = lab(&["demo", "--samples", "300", "--mean-bytes", "20K", "--batch-size", "32"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("10/10 batch files match the manifest (CRC32C)"), "{text}");
    let mountpoint = text.lines().find_map(|l| l.strip_prefix("mount")).and_then(|l| l.split(" -> ").nth(1));
    let mountpoint = Path::new(mountpoint.and_then(|m| m.split(" (").next()).expect("mount row"));
    assert!(!is_mounted(mountpoint), "{} is still mounted", mountpoint.display());
    assert!(!mountpoint.exists(), "the demo left {} behind", mountpoint.display());
}

/// A script standing in for batchfs-server, written into `dir`.
fn fake_server(dir: &Path, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("fake-server");
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A server that exits, or that refuses the demo's options, ends the demo at once with its reason: it
/// waited a minute in silence.
#[test]
fn demo_stops_with_the_server_s_error() {
    let dir = tempfile::tempdir().unwrap();
    let demo = |extra: &[&str]| {
        let started = Instant::now();
        let out = lab(&[&["demo", "--samples", "100", "--mean-bytes", "2K"][..], extra].concat());
        assert!(!out.status.success(), "{extra:?}");
        assert!(started.elapsed() < Duration::from_secs(20), "{extra:?} took {:?}", started.elapsed());
        stderr(&out)
    };
    let failing = fake_server(dir.path(), "echo 'Error: cannot bind 127.0.0.1' >&2; exit 3");
    let e = demo(&["--server", failing.to_str().unwrap()]);
    assert!(e.contains("exited (exit status: 3) before serving the demo: Error: cannot bind 127.0.0.1"), "{e}");
    let e = demo(&["--server", "/bin/true"]);
    assert!(e.contains("/bin/true exited (exit status: 0) before serving the demo: it printed nothing"), "{e}");
    built("batchfs-server");
    let e = demo(&["--batch-size", "0"]);
    assert!(e.contains("the server refused the demo") && e.contains("rejected the options"), "{e}");
    assert!(e.contains("answered 400") && e.contains("batch_size"), "{e}");
}

/// SIGTERM or SIGINT stops the demo, its server and cleans its temporary directory up; the server also
/// goes with a demo killed outright.
#[test]
fn demo_stopped_by_a_signal_leaves_no_server_or_files() {
    for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGKILL] {
        let dir = tempfile::tempdir().unwrap();
        let (tmp, pid_file) = (dir.path().join("tmp"), dir.path().join("server.pid"));
        std::fs::create_dir(&tmp).unwrap();
        let server = fake_server(dir.path(), &format!("echo $$ > {}; exec sleep 60", pid_file.display()));
        let mut demo = Command::new(LAB)
            .args(["demo", "--samples", "100", "--mean-bytes", "2K", "--server", server.to_str().unwrap()])
            .env("TMPDIR", &tmp)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let pid = loop {
            match std::fs::read_to_string(&pid_file).ok().and_then(|p| p.trim().parse::<i32>().ok()) {
                Some(pid) => break pid,
                None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                None => panic!("the server never started"),
            }
        };
        // SAFETY: kill takes plain integers.
        assert_eq!(unsafe { libc::kill(demo.id() as i32, signal) }, 0);
        let status = demo.wait().unwrap();
        assert!(!status.success(), "signal {signal}");
        // Gone, or a zombie waiting for a parent to reap it (the demo's orphans go to whoever reaps here).
        let gone = |pid: i32| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            stat.rsplit_once(") ").is_none_or(|(_, rest)| rest.starts_with('Z'))
        };
        while !gone(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(gone(pid), "signal {signal}: the server outlived the demo");
        if signal != libc::SIGKILL {
            assert_eq!(status.code(), Some(128 + signal));
            let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().collect();
            assert!(left.is_empty(), "signal {signal}: the demo left {left:?}");
        }
    }
}
