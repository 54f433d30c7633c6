//! The `batchfs-server` binary: gen, index (built, then reused), serve from a TOML config with a token,
//! graceful exit on SIGTERM, and clear errors for bad invocations.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_batchfs-server");

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).env("RUST_LOG", "warn").output().unwrap()
}

/// Kills the server if the test fails before it stops.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

async fn wait_healthy(base: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if reqwest::get(format!("{base}/healthz")).await.is_ok_and(|r| r.status().is_success()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("server at {base} did not come up");
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test]
async fn gen_index_serve_and_stop() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("wds");
    let out = run(&[
        "gen",
        "--format",
        "tar",
        "--samples",
        "20",
        "--mean-bytes",
        "2K",
        "--shards",
        "2",
        "--out",
        data.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout(&out).contains("wrote 20 tar samples"), "{}", stdout(&out));
    assert!(data.join("shard-000001.tar").exists());

    let spec = format!("d={}", data.display());
    let first = run(&["index", "--dataset", &spec]);
    assert!(first.status.success(), "{first:?}");
    assert!(stdout(&first).contains("built") && stdout(&first).contains(" 20 "), "{}", stdout(&first));
    let second = run(&["index", "--dataset", &spec]);
    assert!(stdout(&second).contains("reused"), "{}", stdout(&second));

    let port = free_port();
    std::fs::write(dir.path().join("token"), "tok-123\n").unwrap();
    let config = dir.path().join("server.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:{port}\"\ntoken_file = {:?}\n[[dataset]]\nname = \"d\"\npath = {:?}\n\
             [limits]\nstream_window = \"8M\"\ndrain_timeout = \"5s\"\n",
            dir.path().join("token"),
            data
        ),
    )
    .unwrap();
    // The config's datasets are indexed ahead of the server by `index --config` (it took no config, while
    // its error named one); a flag meant for buckets alone is refused.
    let ahead = run(&["index", "--config", config.to_str().unwrap()]);
    assert!(ahead.status.success() && stdout(&ahead).contains("reused"), "{ahead:?}");
    let wrong = run(&["index", "--dataset", &spec, "--index-in-bucket"]);
    assert!(!wrong.status.success(), "{wrong:?}");
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("--index-in-bucket is for s3:// datasets"), "{wrong:?}");
    let energy = dir.path().join("energy.jsonl");
    let child = Command::new(BIN)
        .args(["serve", "--config", config.to_str().unwrap(), "--energy-log", energy.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut guard = Guard(child);
    let base = format!("http://127.0.0.1:{port}");
    wait_healthy(&base).await;
    let client = reqwest::Client::new();
    let denied = client.get(format!("{base}/v1/datasets")).send().await.unwrap();
    assert_eq!(denied.status(), 401);
    let list = client.get(format!("{base}/v1/datasets/d")).bearer_auth("tok-123").send().await.unwrap();
    assert_eq!(list.status(), 200);
    assert!(list.text().await.unwrap().contains("\"samples\": 20"));

    // SIGTERM: a clean exit, promptly.
    let pid = guard.0.id() as i32;
    // SAFETY: kill(2) with a pid we own and a valid signal number has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = guard.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "server ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    // The energy log: a timeline with the bytes served, then a summary (sensors or the reasons there are none).
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&energy).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let summary = &lines.last().unwrap()["summary"];
    assert!(lines.len() >= 2 && summary["bytes"].as_u64().unwrap() > 0, "{summary}");
    // Exactly the sensors this machine has, and each one it lacks with its reason: never a made-up number.
    let (sensors, unavailable) = batchfs_energy::detect(std::path::Path::new("/"), true, batchfs_energy::PROBE);
    let listed = |key: &str| -> Vec<String> {
        summary[key].as_array().unwrap().iter().map(|s| s["sensor"].as_str().unwrap().to_owned()).collect()
    };
    assert_eq!(listed("sensors"), sensors.iter().map(|s| s.name().to_owned()).collect::<Vec<_>>(), "{summary}");
    assert_eq!(listed("unavailable"), unavailable.iter().map(|u| u.sensor.clone()).collect::<Vec<_>>(), "{summary}");
    assert!(summary["unavailable"].as_array().unwrap().iter().all(|u| !u["reason"].as_str().unwrap().is_empty()));
}

fn fails_with(args: &[&str], needle: &str) {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
}

#[test]
fn bad_invocations_say_what_to_fix() {
    fails_with(&["serve", "--listen", "127.0.0.1:0"], "no dataset given");
    fails_with(&["serve", "--listen", "127.0.0.1:0", "--dataset", "d=/nonexistent/x"], "is not a directory");
    fails_with(&["serve", "--dataset", "noequals"], "expected NAME=PATH");
    fails_with(&["serve", "--dataset", "d=/tmp", "--max-frame-size", "1K"], "max_frame_size");
    fails_with(&["serve", "--config", "/nonexistent.toml"], "cannot read config");
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "colour = \"red\"\n").unwrap();
    fails_with(&["serve", "--config", bad.to_str().unwrap()], "invalid config");
    // A config file's dataset names are checked as the flag's are (`../esc` wrote its index outside
    // index_dir, and an empty name was served).
    for name in ["../esc", "", "a/b", "x?y"] {
        let config = dir.path().join("names.toml");
        let text =
            format!("index_dir = \"{0}/idx\"\n[[dataset]]\nname = \"{name}\"\npath = \"{0}\"\n", dir.path().display());
        std::fs::write(&config, text).unwrap();
        fails_with(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()], "dataset name");
    }
    assert!(!dir.path().join("esc.batchfs-index").exists());
    // Object-store settings on a local dataset: refused at start (index_in_bucket was taken silently).
    for setting in ["index_in_bucket = true", "s3 = { region = \"x\" }"] {
        let config = dir.path().join("local.toml");
        let text = format!("[[dataset]]\nname = \"d\"\npath = \"{}\"\n{setting}\n", dir.path().display());
        std::fs::write(&config, text).unwrap();
        fails_with(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()], "are for s3://");
    }
    // An index_dir that is a file, named (an object dataset's staging blamed an object: "File exists").
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let local = format!("d={}", dir.path().display());
    fails_with(
        &["serve", "--listen", "127.0.0.1:0", "--dataset", &local, "--index-dir", file.to_str().unwrap()],
        "not a directory",
    );
    let empty = dir.path().join("token");
    std::fs::write(&empty, "\n").unwrap();
    fails_with(
        &["serve", "--dataset", &format!("d={}", dir.path().display()), "--token-file", empty.to_str().unwrap()],
        "is empty",
    );
    assert!(Path::new(BIN).exists());
}

/// A dataset's directory is walked once per indexing: each link left out is said once (the format's
/// detection and the listing each walked it, and said every warning twice).
#[test]
fn indexing_says_each_link_left_out_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("tree");
    std::fs::create_dir_all(data.join("cats")).unwrap();
    std::fs::write(data.join("cats/a.jpg"), b"cat").unwrap();
    std::os::unix::fs::symlink("/nonexistent/x.jpg", data.join("cats/dangling.jpg")).unwrap();
    std::fs::write(dir.path().join("outside.jpg"), b"out").unwrap();
    std::os::unix::fs::symlink(dir.path().join("outside.jpg"), data.join("cats/out.jpg")).unwrap();
    let out = run(&["index", "--dataset", &format!("d={}", data.display())]);
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("a symbolic link to no file").count(), 1, "{err}");
    assert_eq!(err.matches("a symbolic link out of the dataset's directory").count(), 1, "{err}");
}

/// The README's server-side demo: generates, serves, reads an epoch over HTTP/2 and checks every batch.
#[test]
fn demo_reads_and_verifies_every_batch() {
    let out = run(&["demo", "--samples", "300", "--mean-bytes", "20K", "--batch-size", "32"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = stdout(&out);
    // 300 samples of batch_size 32, last batch kept: 10 batches, each checked against the manifest.
    assert!(text.contains("10/10 batches verified (CRC32C)"), "{text}");
    assert!(text.contains("HTTP/2 (h2c)"), "{text}");
}

/// `serve` listens before it indexes: `/healthz` answers 503 "indexing" with each dataset's progress
/// while a 30,000-file tree is indexed, then 200; the dataset is served once ready.
#[tokio::test]
async fn serve_answers_health_while_indexing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("tree");
    let out = run(&[
        "gen",
        "--format",
        "files",
        "--samples",
        "30000",
        "--mean-bytes",
        "100",
        "--out",
        data.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let port = free_port();
    let child = Command::new(BIN)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--dataset", &format!("t={}", data.display())])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let _guard = Guard(child);
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen_indexing = None;
    loop {
        assert!(Instant::now() < deadline, "the dataset never became ready");
        let Ok(r) = client.get(format!("{base}/healthz")).send().await else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        if r.status() == reqwest::StatusCode::OK {
            break;
        }
        assert_eq!(r.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
        assert!(r.headers().contains_key("retry-after"));
        let text = r.text().await.unwrap();
        assert!(text.starts_with("indexing\nt indexing "), "{text:?}");
        let info = client.get(format!("{base}/v1/datasets/t")).send().await.unwrap();
        assert!(
            info.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE || info.status() == reqwest::StatusCode::OK,
            "{}",
            info.status()
        );
        seen_indexing = Some(text);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen_indexing.is_some(), "the server should answer while it indexes 30,000 files");
    let manifest = client.get(format!("{base}/v1/datasets/t/epochs/0?batch_size=1000")).send().await.unwrap();
    assert_eq!(manifest.status(), reqwest::StatusCode::OK);
}

/// A server whose stderr is a pipe no one reads any longer (`batchfs-server serve ... 2>&1 | head -1`, a
/// log shipper that died) serves and stops at SIGTERM: each failed log write was reported by a panicking
/// `eprintln!`, which killed indexing (503 for good) and the signal handler (SIGTERM ignored).
#[tokio::test]
async fn a_server_whose_stderr_reader_is_gone_serves_through_sighup_and_stops_at_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let out = run(&[
        "gen",
        "--format",
        "tfrecord",
        "--samples",
        "200",
        "--mean-bytes",
        "2000",
        "--out",
        data.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let port = free_port();
    let mut command = Command::new(BIN);
    command
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--dataset", &format!("d={}", data.display())])
        .env("RUST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SIGHUP's default in the server whatever the test's (under `nohup` it is ignored, and so would be
    // passed on): the test must see what the server does with it.
    // SAFETY: `signal` is async-signal-safe, and the closure touches nothing else of the parent.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
            Ok(())
        })
    };
    let mut child = command.spawn().unwrap();
    drop(child.stderr.take());
    let pid = child.id();
    let mut guard = Guard(child);
    wait_healthy(&format!("http://127.0.0.1:{port}")).await;
    // SIGHUP (a closed terminal, or an operator's reload) killed it without a word: ignored, with a warning
    // (written to the pipe no one reads).
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGHUP) }, 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(guard.0.try_wait().unwrap().is_none(), "SIGHUP stopped the server");
    wait_healthy(&format!("http://127.0.0.1:{port}")).await;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = guard.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "SIGTERM did not stop the server");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status}");
}
