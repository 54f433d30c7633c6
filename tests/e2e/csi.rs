//! The CSI node plugin driven as the kubelet drives it: `batchfs-csi` and its holder (the real programs)
//! on a node directory, called over the plugin's unix socket by a client in Python (`grpcio`, with the
//! proto compiled by `grpcio-tools` from the same declarations: none of the plugin's Rust types), over the
//! real server. Published volumes are read by DALI with its defaults and every sample is checked against
//! the plan; readers go on, every byte checked, while the plugin is killed five times and upgraded; bad
//! requests get their documented codes and leave nothing mounted. Where `grpcio` is missing the tests say
//! so and pass, except under CI, which installs it.

use crate::common::{self, fixture, serve, ServeWith};
use crate::loaders::{planned_records, run_loader};
use crate::takeover::{gone, manifest, readers, StopReaders};
use batchfs::index::SourceFormat;
use batchfs::plan::PlanOptions;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const PLUGIN: &str = env!("CARGO_BIN_EXE_batchfs-e2e-csi");
const MOUNT: &str = env!("CARGO_BIN_EXE_batchfs-e2e-mount");

/// A node as the kubelet sees it, in a temporary directory: the plugin's program and the `batchfs`
/// program shipped beside it (`bin/`), the program the holder runs mounts of (`installed/`, installed by
/// the plugin), the holder, the plugin, their sockets and logs, the plugin's state, and the pods' target
/// paths (`pods/`). On drop both processes are stopped and every target unmounted (also on panic).
struct Node {
    dir: tempfile::TempDir,
    holder: Option<Child>,
    plugin: Option<Child>,
    /// The holder runs as the init of a PID namespace of its own, as in its container.
    contained: bool,
}

impl Node {
    fn new() -> Node {
        Node::with_holder(false)
    }

    fn with_holder(contained: bool) -> Node {
        let dir = tempfile::tempdir().unwrap();
        for sub in ["bin", "pods"] {
            std::fs::create_dir(dir.path().join(sub)).unwrap();
        }
        let mut node = Node { dir, holder: None, plugin: None, contained };
        node.replace_programs(false);
        node.start_holder();
        node.start_plugin();
        node
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// Installs the plugin's program and its `batchfs` in `bin/` as a package upgrade does (written beside,
    /// renamed over); with `changed`, a `batchfs` whose bytes differ from the one before (the same program
    /// with bytes appended, which the ELF loader ignores).
    fn replace_programs(&self, changed: bool) {
        for (from, name) in [(PLUGIN, "batchfs-csi"), (MOUNT, "batchfs")] {
            let staged = self.path(&format!("bin/.{name}.new"));
            std::fs::copy(from, &staged).unwrap();
            if changed && name == "batchfs" {
                std::fs::OpenOptions::new().append(true).open(&staged).unwrap().write_all(b"\0upgraded").unwrap();
            }
            std::fs::rename(&staged, self.path(&format!("bin/{name}"))).unwrap();
        }
    }

    fn log(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new().create(true).append(true).open(self.path(name)).unwrap()
    }

    fn logs(&self) -> String {
        let read = |n: &str| std::fs::read_to_string(self.path(n)).unwrap_or_default();
        format!("--- plugin.log\n{}\n--- holder.log\n{}", read("plugin.log"), read("holder.log"))
    }

    fn start_holder(&mut self) {
        let socket = self.path("holder.sock");
        let _ = std::fs::remove_file(&socket);
        let mut command = match self.contained {
            true => {
                let mut c = Command::new("unshare");
                c.args(["--pid", "--fork"]).arg(self.path("bin/batchfs-csi"));
                c
            }
            false => Command::new(self.path("bin/batchfs-csi")),
        };
        let holder = command
            .args(["holder", "--socket"])
            .arg(&socket)
            .arg("--program")
            .arg(self.path("installed/batchfs"))
            .stdout(Stdio::null())
            .stderr(self.log("holder.log"))
            .spawn()
            .unwrap();
        self.holder = Some(holder);
        self.wait_for(&socket);
    }

    fn start_plugin(&mut self) {
        let socket = self.path("csi.sock");
        let _ = std::fs::remove_file(&socket);
        let plugin = Command::new(self.path("bin/batchfs-csi"))
            .arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(["--node-id", "node-1", "--state-dir"])
            .arg(self.path("state"))
            .arg("--holder")
            .arg(format!("unix://{}", self.path("holder.sock").display()))
            .arg("--install-program")
            .arg(self.path("installed/batchfs"))
            .stdout(Stdio::null())
            .stderr(self.log("plugin.log"))
            .spawn()
            .unwrap();
        self.plugin = Some(plugin);
        self.wait_for(&socket);
    }

    fn wait_for(&self, socket: &Path) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "{} never appeared:\n{}", socket.display(), self.logs());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(child: &mut Option<Child>, signal: i32) {
        if let Some(mut c) = child.take() {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(c.id() as i32, signal) };
            let _ = c.wait();
        }
    }

    /// A pod's target path (its parent made, as the kubelet does; the target itself is the plugin's to make).
    fn target(&self, pod: &str) -> PathBuf {
        let dir = self.path(&format!("pods/{pod}/volumes/kubernetes.io~csi"));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("data")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        Node::stop(&mut self.plugin, libc::SIGKILL);
        if let Some(unshare) = self.holder.as_ref().filter(|_| self.contained) {
            // The namespace's init, and with it every process of the namespace (killing `unshare` alone
            // would leave them running).
            for init in children(unshare.id()) {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(init as i32, libc::SIGKILL) };
            }
        }
        Node::stop(&mut self.holder, libc::SIGKILL);
        for pod in std::fs::read_dir(self.path("pods")).into_iter().flatten().flatten() {
            let target = pod.path().join("volumes/kubernetes.io~csi/data");
            if batchfs_mount::plan::is_mountpoint(&target) {
                drop(batchfs_mount::plan::UnmountOnDrop(target));
            }
        }
    }
}

/// The Python CSI client (`tests/python/csi_client.py`), one process for a test's calls.
struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    /// The client of the plugin at `socket`, or `None` where grpcio is missing (outside CI).
    fn new(socket: &Path) -> Option<Client> {
        let probe = Command::new("python3").args(["-c", "import grpc, grpc_tools"]).output();
        if !probe.as_ref().is_ok_and(|o| o.status.success()) {
            assert!(std::env::var_os("CI").is_none(), "CI must install grpcio and grpcio-tools (see .ci/run)");
            eprintln!("skipping the CSI test: pip install grpcio grpcio-tools to run it");
            return None;
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/csi_client.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Some(Client { child, stdin, stdout })
    }

    /// Calls `rpc` with `request`: (the status code's name, its message, the response).
    fn call(&mut self, rpc: &str, request: Value) -> (String, String, Value) {
        writeln!(self.stdin, "{}", json!({"rpc": rpc, "request": request})).unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "the CSI client died calling {rpc}");
        let answer: Value = serde_json::from_str(&line).unwrap();
        (
            answer["code"].as_str().unwrap().to_owned(),
            answer["details"].as_str().unwrap().to_owned(),
            answer["response"].clone(),
        )
    }

    /// Calls `rpc`, which must succeed.
    fn ok(&mut self, rpc: &str, request: Value, node: &Node) -> Value {
        let (code, details, response) = self.call(rpc, request);
        assert_eq!(code, "OK", "{rpc}: {details}\n{}", node.logs());
        response
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A NodePublishVolume request as the kubelet sends it for a PersistentVolume of this driver.
fn publish(volume: &str, target: &Path, url: &str, options: &str, token: Option<&str>) -> Value {
    let mut req = json!({
        "volume_id": volume,
        "target_path": target,
        "volume_capability": {"mount": {}, "access_mode": {"mode": "MULTI_NODE_READER_ONLY"}},
        "readonly": true,
        "volume_context": {
            "url": url,
            "options": options,
            "csi.storage.k8s.io/pod.name": "train-0",
            "csi.storage.k8s.io/ephemeral": "false",
        },
    });
    if let Some(t) = token {
        req["secrets"] = json!({"token": t});
    }
    req
}

fn unpublish(volume: &str, target: &Path) -> Value {
    json!({"volume_id": volume, "target_path": target})
}

/// The Identity RPCs, two volumes published at two targets and read by DALI, publishes asked again
/// (idempotent, and refused with other attributes), both unpublished, and unpublished again.
#[test]
fn two_volumes_published_read_by_dali_and_unpublished_idempotently() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 400, 6_000);
    let server =
        rt.block_on(serve(&[("d", &fx.path)], ServeWith { token: Some("s3cret".into()), ..Default::default() }));
    let node = Node::new();
    let Some(mut client) = Client::new(&node.path("csi.sock")) else { return };

    let info = client.ok("GetPluginInfo", json!({}), &node);
    assert_eq!(info["name"], batchfs_csi::DRIVER_NAME);
    assert_eq!(info["vendor_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(client.ok("GetPluginCapabilities", json!({}), &node), json!({}), "a node plugin: no capability");
    assert_eq!(client.ok("Probe", json!({}), &node)["ready"], true);
    assert_eq!(client.ok("NodeGetInfo", json!({}), &node)["node_id"], "node-1");
    assert_eq!(client.ok("NodeGetCapabilities", json!({}), &node), json!({}), "no stage/unstage: a mount per target");

    let url = format!("{}/d", server.base);
    let volumes = [("vol-a", "pod-a", 32, 5), ("vol-b", "pod-b", 16, 7)];
    let targets: Vec<PathBuf> = volumes.iter().map(|v| node.target(v.1)).collect();
    for ((volume, _, batch, seed), target) in volumes.iter().zip(&targets) {
        let options = format!("batch_size={batch},seed={seed}");
        client.ok("NodePublishVolume", publish(volume, target, &url, &options, Some("s3cret")), &node);
        assert!(batchfs_mount::plan::is_mountpoint(target), "{volume} is mounted at its target");
    }
    for ((volume, _, batch, seed), target) in volumes.iter().zip(&targets) {
        let dir = target.join("epoch-0000");
        let Some(got) = run_loader("python3", "nvidia.dali", &["dali", dir.to_str().unwrap(), "--records"]) else {
            break;
        };
        let plan = PlanOptions { batch_size: *batch, seed: *seed, ..Default::default() };
        assert!(got["records"].as_array().unwrap() == &planned_records(&fx, 0, plan), "{volume}: DALI's records");
        let stats = common::mount_stats(target);
        assert_eq!((stats["errors"].as_u64(), stats["checksum_errors"].as_u64()), (Some(0), Some(0)), "{stats}");
        let write = std::fs::File::create(target.join("epoch-0000/new"));
        assert_eq!(write.unwrap_err().raw_os_error(), Some(libc::EROFS), "{volume} is published read-only");
    }
    // Each mount logs into the state directory (its daemons have no terminal).
    let logs: Vec<String> = std::fs::read_dir(node.path("state/logs"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    assert_eq!(logs.len(), 2);
    assert!(logs.iter().all(|l| l.contains("the worker serves the mount")), "{logs:?}");
    // The token is kept for the mount's workers, readable by root only, and in no record.
    let tokens: Vec<_> = std::fs::read_dir(node.path("state/tokens")).unwrap().flatten().collect();
    assert_eq!(tokens.len(), 2);
    use std::os::unix::fs::PermissionsExt;
    assert!(tokens.iter().all(|t| t.metadata().unwrap().permissions().mode() & 0o777 == 0o600));
    for record in std::fs::read_dir(node.path("state/volumes")).unwrap().flatten() {
        assert!(!std::fs::read_to_string(record.path()).unwrap().contains("s3cret"), "a token in a record");
    }

    // Asked again, as the kubelet does after a restart: done already. With other options: refused.
    client.ok("NodePublishVolume", publish("vol-a", &targets[0], &url, "batch_size=32,seed=5", Some("s3cret")), &node);
    let other = publish("vol-a", &targets[0], &url, "batch_size=64,seed=5", Some("s3cret"));
    let (code, details, _) = client.call("NodePublishVolume", other);
    assert_eq!(code, "ALREADY_EXISTS", "{details}");
    assert!(details.contains("unpublish it first"), "{details}");

    for ((volume, ..), target) in volumes.iter().zip(&targets) {
        client.ok("NodeUnpublishVolume", unpublish(volume, target), &node);
        assert!(!batchfs_mount::plan::is_mountpoint(target), "{volume} unmounted");
        assert!(!target.exists(), "{volume}: the target the plugin made is removed");
        client.ok("NodeUnpublishVolume", unpublish(volume, target), &node);
    }
    assert_eq!(std::fs::read_dir(node.path("state/volumes")).unwrap().count(), 0, "no record left");
    assert_eq!(std::fs::read_dir(node.path("state/tokens")).unwrap().count(), 0, "no token left");
    assert_eq!(std::fs::read_dir(node.path("state/logs")).unwrap().count(), 0, "no log left");
    rt.block_on(server.running.shutdown());
}

/// Four readers hold files open and read, every byte checked, while the plugin is killed with SIGKILL and
/// started again five times (each time answering a publish asked again as done), the holder is killed and
/// started again, and then the plugin is upgraded: its program and the mounts' replaced, the plugin
/// stopped and started, and the mount's worker replaced by the new program. No reader sees an error.
#[test]
fn readers_go_on_while_the_plugin_is_killed_five_times_and_upgraded() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 1_500, 30_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let manifests: Vec<_> = (0..2).map(|e| manifest(&rt, &server.base, e, "batch_size=16")).collect();
    let mut node = Node::new();
    let Some(mut client) = Client::new(&node.path("csi.sock")) else { return };
    let url = format!("{}/d", server.base);
    let target = node.target("train-0");
    let request = publish("vol-1", &target, &url, "batch_size=16", None);
    client.ok("NodePublishVolume", request.clone(), &node);
    let stats = || common::mount_stats(&target);
    let first_worker = stats()["worker_pid"].as_u64().unwrap();
    let (stop, read) = (AtomicBool::new(false), AtomicU64::new(0));
    std::thread::scope(|s| {
        s.spawn(|| readers(&target, &manifests, &stop, &read));
        let _stop = StopReaders(&stop);
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(300));
            Node::stop(&mut node.plugin, libc::SIGKILL);
            node.start_plugin();
            assert_eq!(client.ok("Probe", json!({}), &node)["ready"], true);
            client.ok("NodePublishVolume", request.clone(), &node);
        }
        Node::stop(&mut node.holder, libc::SIGKILL);
        node.start_holder();
        assert_eq!(client.ok("Probe", json!({}), &node)["ready"], true);
        assert_eq!(stats()["worker_pid"].as_u64().unwrap(), first_worker, "the same worker serves still");

        // An upgrade: new programs in place, the old plugin stopped, the new one started.
        let reads_before = read.load(Ordering::Relaxed);
        node.replace_programs(true);
        Node::stop(&mut node.plugin, libc::SIGTERM);
        node.start_plugin();
        let deadline = Instant::now() + Duration::from_secs(60);
        while stats()["worker_pid"].as_u64().unwrap() == first_worker {
            assert!(Instant::now() < deadline, "the mount's worker was not upgraded:\n{}", node.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while read.load(Ordering::Relaxed) < reads_before + 20 {
            assert!(Instant::now() < deadline, "the readers stopped after the upgrade");
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    assert!(read.load(Ordering::Relaxed) > 50, "the readers read across it all");
    let worker = stats()["worker_pid"].as_u64().unwrap();
    let exe = std::fs::read_link(format!("/proc/{worker}/exe")).unwrap();
    assert_eq!(exe, node.path("installed/batchfs"), "the new worker runs the installed program");
    let installed = std::fs::read(node.path("installed/batchfs")).unwrap();
    assert!(installed.ends_with(b"\0upgraded"), "the plugin installed the new program");
    let stats = stats();
    assert_eq!((stats["errors"].as_u64(), stats["checksum_errors"].as_u64()), (Some(0), Some(0)), "{stats}");
    assert!(node.logs().contains("upgraded"), "{}", node.logs());

    client.ok("NodeUnpublishVolume", unpublish("vol-1", &target), &node);
    assert!(!batchfs_mount::plan::is_mountpoint(&target));
    rt.block_on(server.running.shutdown());
}

/// Each bad request gets its documented code and a message that says what to fix, and leaves nothing
/// mounted (nor a target directory the plugin made).
#[test]
fn bad_requests_get_their_codes_and_leave_nothing_mounted() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 100, 2_000);
    let server =
        rt.block_on(serve(&[("d", &fx.path)], ServeWith { token: Some("right".into()), ..Default::default() }));
    let node = Node::new();
    let Some(mut client) = Client::new(&node.path("csi.sock")) else { return };
    let url = format!("{}/d", server.base);
    let target = node.target("pod");
    let good = publish("vol", &target, &url, "batch_size=8", Some("right"));
    let with = |f: &dyn Fn(&mut Value)| {
        let mut r = good.clone();
        f(&mut r);
        r
    };
    let file_target = node.target("file-pod");
    std::fs::write(&file_target, b"not a directory").unwrap();
    let cases: Vec<(&str, Value, &str, &str)> = vec![
        ("no volume id", with(&|r| r["volume_id"] = json!("")), "INVALID_ARGUMENT", "volume_id"),
        ("no target", with(&|r| r["target_path"] = json!("")), "INVALID_ARGUMENT", "target_path"),
        ("relative target", with(&|r| r["target_path"] = json!("pods/x")), "INVALID_ARGUMENT", "not absolute"),
        ("no capability", with(&|r| r["volume_capability"] = json!(null)), "INVALID_ARGUMENT", "volume_capability"),
        ("a block volume", with(&|r| r["volume_capability"] = json!({"block": {}})), "INVALID_ARGUMENT", "block"),
        ("no url", with(&|r| r["volume_context"] = json!({"options": "batch_size=8"})), "INVALID_ARGUMENT", "\"url\""),
        ("a bad url", with(&|r| r["volume_context"]["url"] = json!("ftp://x/d")), "INVALID_ARGUMENT", "url"),
        ("an unknown attribute", with(&|r| r["volume_context"]["option"] = json!("x")), "INVALID_ARGUMENT", "option"),
        (
            "an unknown option",
            with(&|r| r["volume_context"]["options"] = json!("batch_sise=8")),
            "INVALID_ARGUMENT",
            "batch_sise",
        ),
        ("a bad value", with(&|r| r["volume_context"]["options"] = json!("cache=lots")), "INVALID_ARGUMENT", "cache"),
        (
            "a file of the node as the token",
            with(&|r| r["volume_context"]["options"] = json!("token_file=/etc/hostname")),
            "INVALID_ARGUMENT",
            "token_file names a file of the node",
        ),
        (
            "a cache directory outside the plugin's",
            with(&|r| r["volume_context"]["options"] = json!("cache_dir=/var/lib/kubelet")),
            "INVALID_ARGUMENT",
            "cache_dir /var/lib/kubelet is not under",
        ),
        (
            "unsupervised",
            with(&|r| r["volume_context"]["options"] = json!("supervise=false")),
            "INVALID_ARGUMENT",
            "supervise",
        ),
        ("an unknown secret", with(&|r| r["secrets"]["tokn"] = json!("x")), "INVALID_ARGUMENT", "tokn"),
        ("a wrong token", with(&|r| r["secrets"]["token"] = json!("wrong")), "PERMISSION_DENIED", "refused the token"),
        ("no token", with(&|r| r["secrets"] = json!({})), "PERMISSION_DENIED", "token"),
        (
            "an unknown dataset",
            with(&|r| r["volume_context"]["url"] = json!(format!("{}/nope", server.base))),
            "NOT_FOUND",
            "nope",
        ),
        (
            "an unreachable server",
            with(&|r| r["volume_context"]["url"] = json!("http://127.0.0.1:9/d")),
            "UNAVAILABLE",
            "cannot reach",
        ),
        (
            "a cache too small",
            with(&|r| r["volume_context"]["options"] = json!("batch_size=64,cache=64K")),
            "INVALID_ARGUMENT",
            "cache",
        ),
        (
            "a file as target",
            with(&|r| r["target_path"] = json!(file_target)),
            "FAILED_PRECONDITION",
            "not a directory",
        ),
    ];
    for (what, request, want, says) in cases {
        let (code, details, _) = client.call("NodePublishVolume", request);
        assert_eq!(code, want, "{what}: {details}");
        assert!(details.contains(says), "{what}: {details:?} should say {says:?}");
        assert!(!batchfs_mount::plan::is_mountpoint(&target), "{what}: left mounted");
        assert!(!target.exists(), "{what}: the target the plugin made is left");
        assert!(!details.contains("right"), "{what}: the token in a message: {details}");
    }
    assert!(file_target.is_file(), "a file at the target is left as it was");
    assert_eq!(std::fs::read_dir(node.path("state/volumes")).unwrap().count(), 0, "no record left");
    assert_eq!(std::fs::read_dir(node.path("state/tokens")).unwrap().count(), 0, "no token left");
    let (code, details, _) = client.call("NodeUnpublishVolume", json!({"volume_id": "vol"}));
    assert_eq!(code, "INVALID_ARGUMENT", "{details}");
    let (code, details, _) = client.call("NodeStageVolume", json!({}));
    assert_eq!(code, "UNIMPLEMENTED", "{details}");

    // The good request still works after all that, and a second volume at its target is refused.
    client.ok("NodePublishVolume", good.clone(), &node);
    let (code, details, _) = client.call("NodePublishVolume", with(&|r| r["volume_id"] = json!("other")));
    assert_eq!(code, "ALREADY_EXISTS", "{details}");
    let (code, details, _) = client.call("NodeUnpublishVolume", unpublish("other", &target));
    assert_eq!(code, "NOT_FOUND", "{details}");
    assert!(batchfs_mount::plan::is_mountpoint(&target), "another volume's unpublish leaves the mount");
    client.ok("NodeUnpublishVolume", unpublish("vol", &target), &node);

    // Something the plugin did not mount (a tmpfs) is not unmounted by an unpublish, nor its target removed
    // (it was unmounted, lazily, and the directory removed).
    let foreign = node.target("foreign-pod");
    std::fs::create_dir_all(&foreign).unwrap();
    let status = std::process::Command::new("mount").args(["-t", "tmpfs", "tmpfs"]).arg(&foreign).status().unwrap();
    assert!(status.success());
    let _unmount = batchfs_mount::plan::UnmountOnDrop(foreign.clone());
    std::fs::write(foreign.join("kept"), b"a pod's file").unwrap();
    let (code, details, _) = client.call("NodeUnpublishVolume", unpublish("whatever", &foreign));
    assert_eq!(code, "FAILED_PRECONDITION", "{details}");
    assert!(foreign.join("kept").exists(), "the tmpfs is still mounted");

    // A target reached through a symbolic link: mounted where the link leads, found there when asked again.
    let real = node.target("real-pod");
    std::os::unix::fs::symlink(real.parent().unwrap(), node.path("pods/linked")).unwrap();
    let linked = node.path("pods/linked/data");
    client.ok("NodePublishVolume", with(&|r| r["target_path"] = json!(linked)), &node);
    assert!(batchfs_mount::plan::is_mountpoint(&real), "mounted where the link leads");
    client.ok("NodePublishVolume", with(&|r| r["target_path"] = json!(linked)), &node);
    client.ok("NodeUnpublishVolume", unpublish("vol", &linked), &node);
    assert!(!batchfs_mount::plan::is_mountpoint(&real) && !real.exists());
    rt.block_on(server.running.shutdown());
}

/// The children of process `pid`.
fn children(pid: u32) -> Vec<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    text.split_whitespace().map(|p| p.parse().unwrap()).collect()
}

/// Waits until `f` holds, for at most `within`.
fn wait_until(within: Duration, what: &str, node: &Node, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "{what}:\n{}", node.logs());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The holder as its container runs it, the init of a PID namespace: killed with SIGKILL, and again with
/// SIGTERM, it is started again by that init and the mount serves on; the container stopped (SIGTERM to
/// its init, which passes it on and exits 0), the mount's supervisor goes with the namespace and the
/// mount is stale, until the kubelet publishes it again, which detaches the stale mount and mounts anew.
#[test]
fn as_its_containers_init_the_holder_comes_back_and_a_mount_lost_with_it_is_published_again() {
    let rt = common::runtime();
    let fx = fixture(SourceFormat::Tfrecord, 200, 4_000);
    let server = rt.block_on(serve(&[("d", &fx.path)], ServeWith::default()));
    let mut node = Node::with_holder(true);
    let Some(mut client) = Client::new(&node.path("csi.sock")) else { return };
    let target = node.target("train-0");
    let request = publish("vol-1", &target, &format!("{}/d", server.base), "batch_size=16", None);
    client.ok("NodePublishVolume", request.clone(), &node);
    let init = children(node.holder.as_ref().unwrap().id())[0];
    // Init's children: the holder, and the mount's supervisor (re-parented to init once `batchfs mount`
    // returned).
    let holder_of = |init: u32| {
        children(init).into_iter().find(|p| {
            let cmdline = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            !gone(*p as i32) && cmdline.split(|b| *b == 0).any(|arg| arg == b"holder")
        })
    };
    let holder = holder_of(init).unwrap();
    let worker = common::mount_stats(&target)["worker_pid"].as_u64().unwrap();

    // Killed, then the holder started again killed with SIGTERM: each time init starts another.
    let mut holder = holder;
    for signal in [libc::SIGKILL, libc::SIGTERM] {
        let _ = std::fs::remove_file(node.path("holder.sock"));
        // SAFETY: kill has no memory-safety preconditions.
        assert_eq!(unsafe { libc::kill(holder as i32, signal) }, 0);
        wait_until(
            Duration::from_secs(20),
            &format!("init starts the holder again after signal {signal}"),
            &node,
            || {
                holder_of(init).is_some_and(|p| p != holder)
                    && node.path("holder.sock").exists()
                    && client.call("Probe", json!({})).2["ready"] == true
            },
        );
        holder = holder_of(init).unwrap();
        let stats = common::mount_stats(&target);
        assert_eq!(stats["worker_pid"].as_u64().unwrap(), worker, "the mount served on: {stats}");
    }

    // The container stops, as the kubelet stops it: SIGTERM to its init, which passes it to the holder
    // and exits with it, and with init every process of its namespace goes.
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(init as i32, libc::SIGTERM) }, 0);
    let unshare = node.holder.take().unwrap();
    let mut unshare = unshare;
    let status = unshare.wait().unwrap();
    assert!(status.success(), "init exits 0 once the holder has stopped: {status:?}\n{}", node.logs());
    wait_until(Duration::from_secs(20), "the mount is stale once its supervisor is gone", &node, || {
        std::fs::read_dir(&target).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN))
    });
    // Until a holder is back the plugin says it cannot reach one: the kubelet tries again.
    let (code, details, _) = client.call("NodePublishVolume", request.clone());
    assert_eq!(code, "UNAVAILABLE", "{details}");
    node.start_holder();
    client.ok("NodePublishVolume", request.clone(), &node);
    let dir = target.join("epoch-0000");
    let files = std::fs::read_dir(&dir).unwrap().count();
    assert!(files > 0, "the mount serves again");
    client.ok("NodeUnpublishVolume", unpublish("vol-1", &target), &node);
    assert!(!batchfs_mount::plan::is_mountpoint(&target));
    rt.block_on(server.running.shutdown());
}

/// The containers' images the deployment files may name: ours (built by `deploy/Dockerfile`, at this
/// version), the registrar of the CSI project, and the training examples' image.
fn known_image(image: &str) -> bool {
    image == format!("batchfs/batchfs:{}", env!("CARGO_PKG_VERSION"))
        || image == "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0"
        || image == "nvcr.io/nvidia/pytorch:24.10-py3"
}

/// The flags of node-driver-registrar v2.13.0 (its `--help`).
const REGISTRAR_FLAGS: &[&str] =
    &["--v", "--csi-address", "--kubelet-registration-path", "--health-port", "--http-endpoint", "--timeout", "--mode"];

/// The deployment files (`deploy/k8s/`, the CSI driver's and the others) parse (PyYAML), and name only what exists:
/// images above; programs our image installs, with command lines they accept (each line as the kubelet runs it,
/// from the image's ENTRYPOINT, and parsed by its program's own parser); mountpoints that exist when the mount
/// starts and reach the host; registrar flags it has; the driver's name; volume attributes and options the plugin
/// takes (the options parsed by the mount's parser); servers the files define a Service for; secrets the files
/// define; and the holder and the plugin agree on their socket, state directory and program.
#[test]
fn the_deployment_files_parse_and_name_only_what_exists() {
    use clap::Parser;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let yaml = |dir: PathBuf| {
        let files = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path());
        files.filter(|p| p.extension().is_some_and(|e| e == "yaml")).collect::<Vec<_>>()
    };
    // The CSI driver's files, and the server's and the per-node mount's beside them.
    let mut files = yaml(root.join("deploy/k8s/csi"));
    files.extend(yaml(root.join("deploy/k8s")));
    files.sort();
    assert!(files.len() >= 6, "{files:?}");
    let probe = Command::new("python3").args(["-c", "import yaml"]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        assert!(std::env::var_os("CI").is_none(), "CI must install PyYAML (see .ci/run)");
        eprintln!("skipping the deployment files' test: pip install pyyaml to run it");
        return;
    }
    let dump = "import json, sys, yaml\n\
                print(json.dumps([d for f in sys.argv[1:] for d in yaml.safe_load_all(open(f)) if d]))";
    let out = Command::new("python3").args(["-c", dump]).args(&files).output().unwrap();
    assert!(out.status.success(), "the files do not parse: {}", String::from_utf8_lossy(&out.stderr));
    let docs: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    for kind in
        ["CSIDriver", "Namespace", "ServiceAccount", "DaemonSet", "Secret", "PersistentVolume", "Pod", "Deployment"]
    {
        assert!(kinds.contains(&kind), "no {kind} in {kinds:?}");
    }
    let dockerfile = std::fs::read_to_string(root.join("deploy/Dockerfile")).unwrap();
    // The image's ENTRYPOINT and CMD (exec form; an ENTRYPOINT set resets the base image's CMD).
    let instruction = |name: &str| -> Vec<String> {
        let last = dockerfile.lines().filter_map(|l| l.strip_prefix(name)?.strip_prefix(' ')).next_back();
        last.map(|form| serde_json::from_str(form).unwrap_or_else(|e| panic!("{name} {form}: {e}"))).unwrap_or_default()
    };
    let (entrypoint, cmd) = (instruction("ENTRYPOINT"), instruction("CMD"));
    assert!(!entrypoint.is_empty(), "deploy/Dockerfile sets no ENTRYPOINT");
    let named = |d: &Value, kind: &str, name: &str| d["kind"] == kind && d["metadata"]["name"] == name;
    let strings = |v: &Value| -> Option<Vec<String>> {
        let strings = v.as_array()?.iter().map(|a| a.as_str().unwrap().replace("$(NODE_ID)", "node-1"));
        Some(strings.collect())
    };
    // A URL's server is a Service the files define, on one of its ports, in its namespace where named.
    let services = |url: &str| {
        let (base, _) = batchfs_mount::client::parse_url(url).unwrap();
        let (host, port) = base.split_once("://").unwrap().1.rsplit_once(':').expect("a port");
        let (name, namespace) = host.split_once('.').map_or((host, None), |(n, rest)| (n, rest.split('.').next()));
        let service = docs.iter().find(|d| named(d, "Service", name));
        let service = service.unwrap_or_else(|| panic!("{url}: no Service {name} in the files"));
        let own = service["metadata"]["namespace"].as_str().unwrap_or("default");
        assert!(namespace.is_none_or(|n| n == own), "{url}: the Service {name} is in namespace {own}");
        let mut ports = service["spec"]["ports"].as_array().unwrap().iter().map(|p| p["port"].to_string());
        assert!(ports.any(|p| p == port), "{url}: the Service {name} has no port {port}");
    };
    let mut commands = std::collections::HashMap::new();
    for doc in &docs {
        let spec = if doc["kind"] == "Pod" { &doc["spec"] } else { &doc["spec"]["template"]["spec"] };
        for c in spec["containers"].as_array().into_iter().flatten() {
            let image = c["image"].as_str().unwrap();
            assert!(known_image(image), "{}: image {image} is not one that exists", c["name"]);
            let (command, args) = (strings(&c["command"]), strings(&c["args"]));
            if image.starts_with("batchfs/") {
                // As the kubelet runs it: `command` replaces the ENTRYPOINT (and its CMD), `args` alone
                // replace the CMD and follow the ENTRYPOINT.
                let mut line = match (command, args) {
                    (Some(command), args) => [command, args.unwrap_or_default()].concat(),
                    (None, Some(args)) => [entrypoint.clone(), args].concat(),
                    (None, None) => [entrypoint.clone(), cmd.clone()].concat(),
                };
                // `sh -c 'SCRIPT; exec "$@"' NAME ARGS...`: the script, then the program of ARGS.
                let mut script = String::new();
                if line[..2] == ["sh", "-c"] {
                    script = line[2].clone();
                    assert!(script.ends_with("; exec \"$@\""), "{}: the shell must exec its arguments", c["name"]);
                    line.drain(..4);
                }
                let program = &line[0];
                assert!(dockerfile.contains(&format!("/usr/local/bin/{program}\n")), "{program} is not in the image");
                let parsed = match program.as_str() {
                    "batchfs-csi" => batchfs_csi::cli::check_args(line.clone()),
                    "batchfs" => batchfs_mount::cli::Cli::try_parse_from(&line).map(|_| ()).map_err(Into::into),
                    "batchfs-server" => batchfs_server::cli::Cli::try_parse_from(&line).map(|_| ()).map_err(Into::into),
                    other => panic!("no parser for {other}"),
                };
                parsed.unwrap_or_else(|e| panic!("{line:?}: {e}"));
                if program == "batchfs-csi" {
                    commands.insert(if line[1] == "holder" { "holder" } else { "plugin" }, line);
                } else if line[1] == "mount" {
                    let cli = batchfs_mount::cli::Cli::try_parse_from(&line).unwrap();
                    let batchfs_mount::cli::Command::Mount(m) = cli.command else { unreachable!() };
                    services(&m.url);
                    // The mountpoint exists when the mount starts (it refuses a missing one): a volume's path,
                    // or made by the script; and the mount reaches the host: it lies in a volume mounted
                    // with Bidirectional propagation.
                    let mountpoint = m.mountpoint.to_str().unwrap();
                    let mounts = c["volumeMounts"].as_array().unwrap();
                    let made = script.contains(&format!("mkdir -p {mountpoint};"));
                    assert!(made || mounts.iter().any(|v| v["mountPath"] == mountpoint), "nothing makes {mountpoint}");
                    let mut shared = mounts.iter().filter(|v| v["mountPropagation"] == "Bidirectional");
                    let within = |v: &Value| m.mountpoint.starts_with(v["mountPath"].as_str().unwrap());
                    assert!(shared.any(within), "{mountpoint} is in no Bidirectional volume");
                }
                let stop = strings(&c["lifecycle"]["preStop"]["exec"]["command"]).unwrap_or_default();
                if stop.first().is_some_and(|p| p == "batchfs") {
                    batchfs_mount::cli::Cli::try_parse_from(&stop).unwrap_or_else(|e| panic!("{stop:?}: {e}"));
                }
            } else if image.contains("csi-node-driver-registrar") {
                // Its image's ENTRYPOINT is the registrar: `args` are its flags.
                let line = [command.unwrap_or_default(), args.unwrap_or_default()].concat();
                for arg in &line {
                    let flag = arg.split('=').next().unwrap();
                    assert!(REGISTRAR_FLAGS.contains(&flag), "the registrar has no flag {flag}");
                }
                assert!(line.contains(&format!(
                    "--kubelet-registration-path=/var/lib/kubelet/plugins/{}/csi.sock",
                    batchfs_csi::DRIVER_NAME
                )));
            }
        }
        for v in spec["volumes"].as_array().into_iter().flatten().map(|v| &v["csi"]).chain([&doc["spec"]["csi"]]) {
            if v.is_null() {
                continue;
            }
            assert_eq!(v["driver"], batchfs_csi::DRIVER_NAME);
            let attrs = v["volumeAttributes"].as_object().unwrap();
            assert!(attrs.keys().all(|k| k == "url" || k == "options"), "{attrs:?}");
            services(attrs["url"].as_str().unwrap());
            let options = attrs["options"].as_str().unwrap();
            batchfs_mount::options::MountOptions::default().apply_list(options).unwrap();
            let secret = v["nodePublishSecretRef"]["name"].as_str().unwrap();
            let defined =
                docs.iter().find(|d| named(d, "Secret", secret)).unwrap_or_else(|| panic!("no secret {secret}"));
            assert!(defined["stringData"]["token"].is_string(), "the secret holds the token");
        }
    }
    assert!(docs.iter().any(|d| named(d, "CSIDriver", batchfs_csi::DRIVER_NAME)));
    let flag = |line: &Vec<String>, f: &str| line[line.iter().position(|a| a == f).unwrap() + 1].clone();
    let (plugin, holder) = (&commands["plugin"], &commands["holder"]);
    assert_eq!(flag(plugin, "--holder"), format!("unix://{}", flag(holder, "--socket")), "one holder socket");
    assert_eq!(flag(plugin, "--install-program"), flag(holder, "--program"), "one program");
    assert!(flag(holder, "--socket").starts_with(&flag(plugin, "--state-dir")), "the socket in the shared state");
}
