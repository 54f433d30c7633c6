//! Helpers shared by the end-to-end tests: generated datasets with their expected samples, a running
//! server, and HTTP/2 clients.

use batchfs::gen::{self, GenOptions};
use batchfs::index::SourceFormat;
use batchfs::source::{IndexOptions, NoProgress};
use batchfs_server::catalog::{Catalog, Dataset};
use batchfs_server::config::ServerLimits;
use batchfs_server::{RunningServer, ServeOptions, TlsFiles};
use std::path::{Path, PathBuf};
use std::process::Command;
use tempfile::TempDir;

/// A generated dataset on disk.
pub struct Fixture {
    _dir: TempDir,
    pub path: PathBuf,
    pub options: GenOptions,
}

/// Generates a small dataset of `format`.
pub fn fixture(format: SourceFormat, samples: u32, mean_bytes: u64) -> Fixture {
    fixture_in(format, samples, mean_bytes, 4)
}

/// Generates a small dataset of `format` in `shards` shards.
pub fn fixture_in(format: SourceFormat, samples: u32, mean_bytes: u64, shards: u32) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format.as_str());
    let options = GenOptions { format, samples, mean_bytes, shards, classes: 6, seed: 11, ..Default::default() };
    gen::generate(&options, &path).unwrap();
    Fixture { _dir: dir, path, options }
}

/// A sample as the server should deliver it.
#[derive(Debug, Clone)]
pub struct Expected {
    pub key: String,
    pub label: i64,
    /// (extension, bytes), in member order.
    pub parts: Vec<(String, Vec<u8>)>,
}

/// The samples of a fixture in index order (the order plans permute).
pub fn expected_samples(fx: &Fixture) -> Vec<Expected> {
    let o = &fx.options;
    let mut samples: Vec<gen::GenSample> = (0..o.samples).map(|i| gen::sample(o, i)).collect();
    match o.format {
        SourceFormat::Tfrecord => samples
            .iter()
            .map(|s| Expected {
                key: s.key.clone(),
                label: s.label,
                parts: vec![("example".into(), gen::example_bytes(s))],
            })
            .collect(),
        SourceFormat::Lmdb => samples
            .iter()
            .map(|s| Expected {
                key: s.key.clone(),
                label: s.label,
                parts: vec![("datum".into(), gen::datum_bytes(s))],
            })
            .collect(),
        SourceFormat::Tar => samples
            .iter()
            .map(|s| Expected {
                key: s.key.clone(),
                label: s.label,
                parts: vec![("jpg".into(), s.data.clone()), ("cls".into(), s.label.to_string().into_bytes())],
            })
            .collect(),
        SourceFormat::Files => {
            samples.sort_by_key(|s| (gen::class_name(s.label), s.key.clone()));
            let mut classes: Vec<i64> = samples.iter().map(|s| s.label).collect();
            classes.dedup();
            samples
                .iter()
                .map(|s| Expected {
                    key: format!("{}/{}", gen::class_name(s.label), s.key),
                    label: classes.iter().position(|&c| c == s.label).unwrap() as i64,
                    parts: vec![("jpg".into(), s.data.clone())],
                })
                .collect()
        }
    }
}

/// A server running in this process on a loopback port.
pub struct Server {
    pub running: RunningServer,
    pub base: String,
}

/// Options for [`serve`].
#[derive(Default)]
pub struct ServeWith {
    pub token: Option<String>,
    pub tls: Option<TlsFiles>,
    pub limits: Option<ServerLimits>,
    /// Links out of the datasets' directories are followed (`--follow-links`).
    pub follow_links: bool,
}

/// Indexes the datasets and starts a server on 127.0.0.1 with an ephemeral port.
pub async fn serve(datasets: &[(&str, &Path)], with: ServeWith) -> Server {
    let limits = with.limits.unwrap_or_default();
    let catalog = Catalog::default();
    for (name, path) in datasets {
        let io = limits.io_policy();
        let options = IndexOptions { follow_links: with.follow_links, ..IndexOptions::default() };
        catalog.insert(Dataset::open(name, path, None, &options, &NoProgress, io).unwrap()).unwrap();
    }
    let scheme = if with.tls.is_some() { "https" } else { "http" };
    let running = batchfs_server::start(
        catalog,
        ServeOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            tls: with.tls,
            token: with.token.map(String::into_bytes),
            limits,
        },
    )
    .await
    .unwrap();
    let base = format!("{scheme}://localhost:{}", running.local_addr().port());
    Server { running, base }
}

/// A runtime for a test's server and HTTP requests.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The manifest of `epoch` of `dataset` with plan options `query`, straight from the server.
pub fn manifest_of(
    rt: &tokio::runtime::Runtime,
    server: &Server,
    dataset: &str,
    epoch: u64,
    query: &str,
) -> batchfs::api::Manifest {
    let url = format!("{}{}?{query}", server.base, batchfs::api::manifest_path(dataset, epoch));
    rt.block_on(async { h2c().get(url).send().await.unwrap().json().await.unwrap() })
}

/// The body of batch `batch` of `epoch` of dataset `d` as the server sends it for `query`.
pub fn batch_body(rt: &tokio::runtime::Runtime, server: &Server, epoch: u64, batch: u64, query: &str) -> Vec<u8> {
    let url = format!("{}{}?{query}", server.base, batchfs::api::batch_path("d", epoch, batch));
    rt.block_on(async { h2c().get(url).send().await.unwrap().bytes().await.unwrap().to_vec() })
}

/// `rolling/`'s slot table of dataset `d` with plan options `query` over `epochs` epochs from
/// `first_epoch`, straight from the server.
pub fn slot_table(
    rt: &tokio::runtime::Runtime,
    server: &Server,
    query: &str,
    first_epoch: u64,
    epochs: u64,
) -> batchfs::api::SlotTable {
    let url =
        format!("{}{}?{query}&first_epoch={first_epoch}&epochs={epochs}", server.base, batchfs::api::rolling_path("d"));
    rt.block_on(async {
        let response = h2c().get(url).send().await.unwrap();
        assert!(response.status().is_success(), "{}", response.status());
        response.json().await.unwrap()
    })
}

/// The file `rolling/` shows for batch `body` (a TFRecord batch as the server sends it, batch `batch`)
/// in the indexed layout of `table`: each record at its slot, zeros elsewhere.
pub fn placed(body: &[u8], batch: u64, table: &batchfs::api::SlotTable) -> Vec<u8> {
    let layout = batchfs::rolling::FileLayout::new(batch, &table.batches[batch as usize]);
    let frames = batchfs::rolling::frames_of(body).unwrap();
    let lens: Vec<u64> = frames.iter().map(|f| f.1).collect();
    let mut out = vec![0; layout.len as usize];
    for ((from, len), p) in frames.into_iter().zip(layout.positions(batch, &lens).unwrap()) {
        let at = layout.offsets[p] as usize;
        out[at..at + len as usize].copy_from_slice(&body[from as usize..(from + len) as usize]);
    }
    out
}

/// An HTTP/2 client with prior knowledge (h2c).
pub fn h2c() -> reqwest::Client {
    let limits = ServerLimits::default();
    reqwest::Client::builder()
        .http2_prior_knowledge()
        .http2_initial_stream_window_size(limits.stream_window)
        .http2_initial_connection_window_size(limits.connection_window)
        .http2_max_frame_size(limits.max_frame_size)
        .build()
        .unwrap()
}

/// Runs `tests/python/read_batches.py` on a batch file, or `None` where its Python modules are missing
/// (outside CI; `.ci/run` installs them, and there a missing module fails the test).
pub fn python_read(args: &[&str]) -> Option<serde_json::Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/read_batches.py");
    let probe = Command::new("python3").args(["-c", "import tfrecord, webdataset, crc32c"]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must install the Python readers (pip install tfrecord webdataset)"
        );
        eprintln!("skipping the Python reader check: pip install tfrecord webdataset crc32c to run it");
        return None;
    }
    let out = Command::new("python3").arg(script).args(args).output().unwrap();
    assert!(out.status.success(), "read_batches.py failed: {}", String::from_utf8_lossy(&out.stderr));
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

/// A dataset mounted for real (FUSE) in this process from `server`; unmounted on drop, also when a
/// test panics.
pub fn mount(server: &Server, dataset: &str, options: &str) -> (TempDir, batchfs_mount::mount::Mounted) {
    mount_url(&format!("{}/{dataset}", server.base), options)
}

/// Like [`mount`], of the dataset at `url` (a server behind `batchfs-lab netem`, say).
pub fn mount_url(url: &str, options: &str) -> (TempDir, batchfs_mount::mount::Mounted) {
    let dir = tempfile::tempdir().unwrap();
    let mut o = batchfs_mount::options::MountOptions::default();
    o.apply_list(options).unwrap();
    let plan = batchfs_mount::plan::plan(url, dir.path(), o).unwrap();
    let mounted = batchfs_mount::mount::spawn(&plan).unwrap();
    (dir, mounted)
}

/// Starts a server on a given address (to restart one where it was).
pub async fn serve_on(addr: std::net::SocketAddr, datasets: &[(&str, &Path)]) -> Server {
    let catalog = Catalog::default();
    let io = ServerLimits::default().io_policy();
    for (name, path) in datasets {
        catalog.insert(Dataset::open(name, path, None, &IndexOptions::default(), &NoProgress, io).unwrap()).unwrap();
    }
    let options = ServeOptions { listen: addr, tls: None, token: None, limits: ServerLimits::default() };
    let running = batchfs_server::start(catalog, options).await.unwrap();
    let base = format!("http://localhost:{}", running.local_addr().port());
    Server { running, base }
}

/// Indexes dataset `d` (`fx`'s) again with other files under whatever mounts it, as a server restarted
/// over a changed dataset does: stops `server`, makes the fixture anew with another seed (other bytes,
/// sizes and labels; the same shard names, a file tree's files in other class folders) and serves it where
/// `server` was.
pub fn index_again(rt: &tokio::runtime::Runtime, server: Server, fx: &mut Fixture) -> Server {
    let addr = server.running.local_addr();
    rt.block_on(server.running.shutdown());
    fx.options.seed += 1;
    std::fs::remove_dir_all(&fx.path).unwrap();
    gen::generate(&fx.options, &fx.path).unwrap();
    rt.block_on(serve_on(addr, &[("d", &fx.path)]))
}

/// The names in directory `dir`, sorted, or why it cannot be listed.
pub fn names_in(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut names = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<Vec<_>>>()?;
    names.sort();
    Ok(names)
}

/// Maps a file read-only and private, and copies its bytes out (the mount must serve mmap readers).
pub fn map_file(file: &std::fs::File) -> Vec<u8> {
    let map = batchfs::mmap::MappedFile::open_file(file).unwrap();
    map.bytes().to_vec()
}

/// The mount's live counters (`.batchfs/stats`).
pub fn mount_stats(mountpoint: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(mountpoint.join(".batchfs/stats")).unwrap()).unwrap()
}

/// Waits until the mount's counter `key` reaches `at_least` and returns its value. The kernel sends a
/// file's RELEASE after `close` or `munmap` has returned (asynchronously), so what the daemon does at
/// release is seen a moment later; a counter still short after 10 s fails the test with its value.
pub fn wait_for_stat(mountpoint: &Path, key: &str, at_least: u64) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let value = mount_stats(mountpoint)[key].as_u64().unwrap();
        if value >= at_least || std::time::Instant::now() > deadline {
            return value;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Every file of dataset `name` on the server at `base`, walking its directories page by page.
pub async fn all_files(client: &reqwest::Client, base: &str, name: &str) -> Vec<batchfs::api::FileEntry> {
    let mut out = Vec::new();
    let mut pending = vec![String::new()];
    while let Some(dir) = pending.pop() {
        let mut q = batchfs::api::FilesQuery { dir: dir.clone(), ..Default::default() };
        loop {
            let url = format!("{base}{}?{}", batchfs::api::files_path(name), q.to_query());
            let page: batchfs::api::FileList = client.get(url).send().await.unwrap().json().await.unwrap();
            let prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
            pending.extend(page.dirs.iter().map(|d| format!("{prefix}{d}")));
            out.extend(page.files);
            match page.next {
                Some(next) => q.cursor = next,
                None => break,
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}
