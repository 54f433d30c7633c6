//! Mounting: checking the mountpoint and the server before anything is mounted (so errors reach the
//! terminal), daemonizing, tuning the kernel readahead, and unmounting on a signal.

use crate::client::{parse_url, BatchClient, ClientError, HttpClient, HttpConfig};
use crate::fs::{Fs, FsOptions};
use crate::fuse::FuseFs;
use crate::node_cache::NodeCache;
use crate::options::MountOptions;
use crate::prefetch::{Prefetcher, PrefetcherConfig};
use crate::sys;
use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// A validated mount: where, from where, how.
pub struct MountPlan {
    pub url: String,
    pub mountpoint: PathBuf,
    pub options: MountOptions,
    pub http: HttpConfig,
    /// The dataset as the server described it when the mount was planned.
    pub info: batchfs::api::DatasetInfo,
}

/// How to reach the servers of dataset `url` with `options` (its token read from `token_file`).
pub fn http_config(url: &str, options: &MountOptions) -> Result<HttpConfig> {
    let (base, dataset) = parse_url(url)?;
    let token = match &options.token_file {
        Some(path) => {
            let t =
                std::fs::read_to_string(path).with_context(|| format!("cannot read token_file {}", path.display()))?;
            Some(t.trim().to_owned()).filter(|t| !t.is_empty())
        }
        None => None,
    };
    let mut servers = vec![base];
    servers.extend(options.servers.iter().cloned());
    Ok(HttpConfig {
        servers,
        dataset,
        query: options.query(),
        token,
        connections: options.connections,
        ca_file: options.ca_file.clone(),
        stall_timeout: options.stall_timeout,
        connect_timeout: Duration::from_secs(10),
        frame_size: options.frame_size,
    })
}

/// `batchfs warm`: fills the node cache (`cache_dir`, which every mount of the node then reads before the
/// network) with the files below `dir` (`""`: all) of the file-tree dataset at `url`, without a mount, in
/// the first epoch's plan order, printing progress; the number of files it could not fetch.
pub fn warm_only(url: &str, dir: &str, options: &MountOptions) -> Result<u64> {
    let cache_path =
        options.cache_dir.as_ref().context("batchfs warm fills a node cache: give it one (-o cache_dir=PATH)")?;
    let http = http_config(url, options)?;
    let runtime = runtime()?;
    let client: crate::client::DynClient = Arc::new(HttpClient::new(http)?);
    let info = runtime.block_on(client.dataset()).context("cannot describe the dataset")?;
    if info.format != batchfs::index::SourceFormat::Files {
        bail!("batchfs warm warms a file tree's files; dataset {:?} is {} shards", info.name, info.format.as_str());
    }
    let cache = NodeCache::open(cache_path, options.cache_dir_size)
        .with_context(|| format!("cannot use {}", cache_path.display()))?;
    let stats = Arc::new(crate::stats::Stats::default());
    let table = Arc::new(runtime.block_on(client.sample_table()).context("cannot fetch the sample table")?);
    let progress = {
        let stats = stats.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_secs(2));
            let s = stats.snapshot();
            let Some(w) = s.warm else { continue };
            eprintln!(
                "warm: {}/{} files, {:.1}/{:.1} MB",
                w.files,
                w.files_total,
                w.bytes as f64 / 1e6,
                w.bytes_total as f64 / 1e6
            );
            if w.files >= w.files_total {
                return;
            }
        })
    };
    let mut order = crate::warm::plan_order(&table, options.plan, options.first_epoch);
    if !dir.is_empty() {
        let below: std::collections::HashSet<u32> = runtime
            .block_on(crate::warm::samples_under(&client, dir))
            .with_context(|| format!("cannot list {dir:?} of the dataset"))?
            .into_iter()
            .collect();
        if below.is_empty() {
            bail!("the dataset has no file below {dir:?}");
        }
        order.retain(|id| below.contains(id));
    }
    let failed = runtime.block_on(crate::warm::warm(client, cache, table, order, stats.clone()));
    let s = stats.snapshot().warm.unwrap_or_default();
    drop(progress);
    println!(
        "warmed {}/{} files ({:.1} MB) into {} in {} s",
        s.files,
        s.files_total,
        s.bytes as f64 / 1e6,
        cache_path.display(),
        s.seconds
    );
    Ok(failed)
}

/// Checks the options, the mountpoint (cleaning up a stale mount left by a killed daemon) and the
/// server (reachable, dataset known, token accepted) before mounting.
pub fn plan(url: &str, mountpoint: &Path, options: MountOptions) -> Result<MountPlan> {
    plan_at(url, mountpoint, options, true)
}

/// [`plan`]; without `check_mountpoint`, the mountpoint is taken as it is (a mount systemd kept for a
/// supervisor to take over: no worker answers there yet, so looking into it would wait for ever).
fn plan_at(url: &str, mountpoint: &Path, options: MountOptions, check_mountpoint: bool) -> Result<MountPlan> {
    let http = http_config(url, &options)?;
    let mountpoint = match check_mountpoint {
        true => prepare_mountpoint(mountpoint)?,
        false => std::fs::canonicalize(mountpoint).with_context(|| format!("mountpoint {}", mountpoint.display()))?,
    };
    let info = probe(&http, &options)?;
    if options.warm == crate::options::Warm::Raw {
        if options.cache_dir.is_none() {
            bail!("warm=raw fills the node cache: give it one (cache_dir=PATH)");
        }
        if info.format != batchfs::index::SourceFormat::Files {
            bail!("warm=raw warms a file tree's files; dataset {:?} is {} shards", info.name, info.format.as_str());
        }
    }
    Ok(MountPlan { url: url.to_owned(), mountpoint, options, http, info })
}

/// Whether something is mounted at `path` (as `/proc/self/mountinfo` names it: canonical).
pub fn is_mountpoint(path: &Path) -> bool {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mountinfo") else { return false };
    let target = path.to_string_lossy().replace(' ', "\\040");
    mounts.lines().any(|l| l.split(' ').nth(4) == Some(target.as_str()))
}

/// Unmounts `path` (lazily) when dropped, also while a panic unwinds: what a test or a tool that mounts
/// holds so that nothing stays mounted behind it.
pub struct UnmountOnDrop(pub PathBuf);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        // Nothing mounted there (already unmounted): an error, ignored.
        let _ = sys::unmount(&self.0, true);
    }
}

fn prepare_mountpoint(path: &Path) -> Result<PathBuf> {
    // Listing the directory reaches the filesystem (a stat may be answered from the kernel's cache).
    let probe =
        std::fs::metadata(path).and_then(|m| if m.is_dir() { std::fs::read_dir(path).map(|_| m) } else { Ok(m) });
    match probe {
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED)) => {
            // A FUSE mount whose daemon died ("Transport endpoint is not connected", or "Software caused
            // connection abort" for a request made as it went): detach it.
            tracing::warn!(path = %path.display(), "cleaning up a stale mount (its daemon is gone)");
            sys::unmount(path, true)
                .with_context(|| format!("cannot clean up the stale mount at {}", path.display()))?;
        }
        Err(e) => bail!("mountpoint {}: {e}", path.display()),
        Ok(m) if !m.is_dir() => bail!("mountpoint {} is not a directory", path.display()),
        Ok(_) => {}
    }
    let path = std::fs::canonicalize(path).with_context(|| format!("mountpoint {}", path.display()))?;
    if is_mountpoint(&path) {
        bail!(
            "{} is busy: something is already mounted there (batchfs umount {} first)",
            path.display(),
            path.display()
        );
    }
    Ok(path)
}

/// The epochs, from `first_epoch`, whose largest batch `mount` checks the cache can hold twice (a later
/// one larger still fails its reads with EIO, and says to raise `cache`).
const CHECKED_EPOCHS: u64 = 3;

/// Why the server turned a mount down before anything was mounted, with the server's answer as its cause:
/// what a caller maps to its own codes (the CSI plugin to gRPC's), found in an error by downcasting.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("dataset {dataset:?} unknown to {server}")]
    UnknownDataset { dataset: String, server: String, source: ClientError },
    #[error("{server} refused the token")]
    Token { server: String, source: ClientError },
    #[error("{server} rejected the options")]
    Options { server: String, source: ClientError },
    #[error("server unreachable")]
    Unreachable { source: ClientError },
}

/// Checks that the server of `url` serves its dataset with `options` (reachable, dataset known, token
/// accepted, plan valid, cache large enough), as a mount does before mounting; a [`Refused`] error says
/// which of these failed.
pub fn check(url: &str, options: &MountOptions) -> Result<batchfs::api::DatasetInfo> {
    probe(&http_config(url, options)?, options)
}

fn probe(http: &HttpConfig, options: &MountOptions) -> Result<batchfs::api::DatasetInfo> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let client = HttpClient::new(http.clone())?;
    let server = &http.servers[0];
    // A server still indexing the dataset answers 503: wait for it, up to `timeout` (a mount started at
    // boot beside a server that is indexing). Anything else fails now, before daemonizing.
    let deadline = std::time::Instant::now() + options.timeout;
    let result = runtime.block_on(async {
        loop {
            let attempt = async {
                let info = client.dataset().await?;
                let mut manifests = Vec::new();
                for epoch in options.first_epoch..options.first_epoch + options.epochs.clamp(1, CHECKED_EPOCHS) {
                    manifests.push(client.manifest(epoch, options.format).await?);
                }
                Ok::<_, ClientError>((info, manifests))
            };
            match attempt.await {
                Err(ClientError::Status { status: 503, .. }) if std::time::Instant::now() < deadline => {
                    tracing::info!(%server, dataset = %http.dataset, "the server is not ready (indexing?): waiting");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                other => return other,
            }
        }
    });
    // Join the runtime's threads now: a daemonizing caller forks next.
    runtime.shutdown_timeout(Duration::from_secs(5));
    let (info, manifests) = result.map_err(|e| {
        let (server, dataset) = (server.to_string(), http.dataset.clone());
        match &e {
            ClientError::Status { status: 404, .. } => Refused::UnknownDataset { dataset, server, source: e },
            ClientError::Status { status: 401, .. } => Refused::Token { server, source: e },
            ClientError::Status { status: 400, .. } => Refused::Options { server, source: e },
            _ => Refused::Unreachable { source: e },
        }
    })?;
    let largest = manifests.iter().flat_map(|m| m.batches.iter().map(move |b| (b.bytes, m.epoch))).max();
    if let Some((bytes, epoch)) = largest.filter(|&(bytes, _)| options.cache < 2 * bytes) {
        bail!(
            "cache={} cannot hold two batches of {bytes} bytes (the largest of epoch {epoch}); raise cache or lower \
             batch_size",
            options.cache
        );
    }
    Ok(info)
}

pub(crate) fn fuser_config(plan: &MountPlan) -> fuser::Config {
    use fuser::MountOption as M;
    let mut config = fuser::Config::default();
    config.mount_options =
        vec![M::FSName(plan.url.clone()), M::Subtype("batchfs".into()), M::RO, M::NoAtime, M::NoDev, M::NoSuid];
    if plan.options.allow_other {
        config.acl = fuser::SessionACL::All;
        config.mount_options.push(M::DefaultPermissions);
    }
    if plan.options.auto_unmount {
        config.mount_options.push(M::AutoUnmount);
    }
    config.n_threads = Some(plan.options.threads);
    config.clone_fd = true;
    config
}

/// Builds the filesystem on `runtime`.
fn filesystem(plan: &MountPlan, runtime: &tokio::runtime::Runtime) -> Result<(FuseFs, Arc<Prefetcher>)> {
    if plan.options.passthrough && plan.options.huge_pages {
        match sys::use_huge_pages() {
            Ok(()) => tracing::debug!("memory files on a private huge-page tmpfs"),
            Err(e) => tracing::info!(error = %e, "memory files are memfds of 4 KiB pages: no huge-page tmpfs"),
        }
    }
    let client = Arc::new(HttpClient::new(plan.http.clone())?);
    let health = client.health();
    let prefetcher = Prefetcher::new(client, runtime.handle().clone(), PrefetcherConfig::from(&plan.options));
    let _ = prefetcher.stats.servers.set(health);
    if let Some(dir) = &plan.options.cache_dir {
        let cache = NodeCache::open(dir, plan.options.cache_dir_size)
            .with_context(|| format!("cannot use cache_dir {}", dir.display()))?;
        prefetcher.use_node_cache(cache.clone());
        let _ = prefetcher.stats.node_cache.set(cache);
    }
    let (uid, gid) = sys::ids();
    let fs = Fs::new(
        prefetcher.clone(),
        FsOptions {
            epochs: plan.options.epochs,
            format: plan.options.format,
            uid,
            gid,
            time: SystemTime::now(),
            raw: true,
            rolling: plan.options.rolling,
            first_epoch: plan.options.first_epoch,
            // A file tree labelled by its first directories: ImageFolder's layout.
            classes: match plan.info.format {
                batchfs::index::SourceFormat::Files => plan.info.classes.clone(),
                _ => Vec::new(),
            },
        },
    );
    Ok((FuseFs::new(fs, plan.options.passthrough), prefetcher))
}

/// Raises the mount's kernel readahead (root only; best effort): larger FUSE reads, fewer round trips.
fn tune_readahead(mountpoint: &Path, kb: u32) {
    if kb == 0 || !sys::is_root() {
        return;
    }
    let Ok(meta) = std::fs::metadata(mountpoint) else { return };
    let dev = meta.dev();
    let (major, minor) = ((dev >> 8) & 0xfff | (dev >> 32) & !0xfff, (dev & 0xff) | (dev >> 12) & !0xff);
    let path = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    if let Err(e) = std::fs::write(&path, kb.to_string()) {
        tracing::debug!(%path, error = %e, "cannot set read_ahead_kb");
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("batchfs-io").enable_all().build()?)
}

/// A mount served by this process in the background (for `demo` and tests); unmounted on drop.
pub struct Mounted {
    session: Option<fuser::BackgroundSession>,
    runtime: Option<tokio::runtime::Runtime>,
    pub mountpoint: PathBuf,
    pub prefetcher: Arc<Prefetcher>,
}

impl Mounted {
    /// Unmounts and waits for the session to end.
    pub fn unmount(mut self) -> Result<()> {
        self.stop()
    }

    /// Serves until the filesystem is unmounted from outside (`batchfs umount`, umount(8), a signal).
    pub fn wait(mut self) -> Result<()> {
        if let Some(session) = self.session.take() {
            session.join().context("FUSE session")?;
        }
        self.stop()
    }

    /// The runtime the mount's fetches run on.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        self.runtime.as_ref().expect("running").handle()
    }

    fn stop(&mut self) -> Result<()> {
        if let Some(session) = self.session.take() {
            session.umount_and_join().with_context(|| format!("unmounting {}", self.mountpoint.display()))?;
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
        Ok(())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(error = %e, "unmount failed; detaching lazily");
            let _ = sys::unmount(&self.mountpoint, true);
        }
    }
}

/// Mounts in this process, serving from background threads (the session loop answers before the
/// readahead tuning stats the mountpoint).
pub fn spawn(plan: &MountPlan) -> Result<Mounted> {
    let (runtime, fs, prefetcher, notifier) = prepare(plan)?;
    let device = fs.device();
    let session = fuser::Session::new(fs, &plan.mountpoint, &fuser_config(plan))
        .with_context(|| format!("cannot mount at {}", plan.mountpoint.display()))?;
    let _ = notifier.set(session.notifier());
    let _ = device.set(std::os::fd::AsFd::as_fd(&session).try_clone_to_owned()?);
    let session = session.spawn()?;
    serving(plan, &runtime, &prefetcher)?;
    Ok(Mounted { session: Some(session), runtime: Some(runtime), mountpoint: plan.mountpoint.clone(), prefetcher })
}

/// A worker's mount: serves the connection the supervisor holds (`start`), taking over from the worker
/// before it (`supervise.rs`), in background threads.
fn take_over(plan: &MountPlan, start: &crate::supervise::WorkerStart) -> Result<Mounted> {
    let (runtime, fs, prefetcher, notifier) = prepare(plan)?;
    let _ = prefetcher.stats.ledger.set(start.ledger.clone());
    let fs = fs.take_over(start.ledger.clone(), start.settings, start.fuse.try_clone()?);
    let mut config = fuser_config(plan);
    // Re-sent requests are the connection's only if every thread reads the supervisor's descriptor; else
    // each reads a clone of its own, whose requests fail when this worker dies.
    config.clone_fd = !start.settings.resend;
    let fd = match start.settings.resend {
        true => start.fuse.try_clone()?,
        false => sys::clone_fuse(std::os::fd::AsFd::as_fd(&start.fuse)).context("cannot clone the connection")?,
    };
    let session = fuser::Session::from_fd_initialized(fs, fd, config.acl, config);
    let _ = notifier.set(session.notifier());
    let session = session.spawn()?;
    if start.settings.resend {
        // What the dead worker had read and not answered comes again, to this one.
        if let Err(e) = sys::notify_resend(std::os::fd::AsFd::as_fd(&start.fuse)) {
            tracing::warn!(error = %e, "the kernel refused to re-send the dead worker's requests");
        }
    }
    serving(plan, &runtime, &prefetcher)?;
    Ok(Mounted { session: Some(session), runtime: Some(runtime), mountpoint: plan.mountpoint.clone(), prefetcher })
}

/// The runtime, the filesystem and its prefetcher, and where the session's notifier goes once it exists
/// (to drop the page cache of closed files, with `page_cache=drop`).
type Prepared = (tokio::runtime::Runtime, FuseFs, Arc<Prefetcher>, Arc<std::sync::OnceLock<fuser::Notifier>>);

fn prepare(plan: &MountPlan) -> Result<Prepared> {
    let runtime = runtime()?;
    let (mut fs, prefetcher) = filesystem(plan, &runtime)?;
    let notifier = Arc::new(std::sync::OnceLock::new());
    if plan.options.page_cache == crate::options::PageCache::Drop {
        fs = fs.drop_page_cache(notifier.clone());
    }
    Ok((runtime, fs, prefetcher, notifier))
}

/// What starts once a mount serves: metrics, the kernel readahead, warming.
fn serving(plan: &MountPlan, runtime: &tokio::runtime::Runtime, prefetcher: &Arc<Prefetcher>) -> Result<()> {
    if let Some(addr) = plan.options.metrics {
        crate::metrics::serve(addr, prefetcher.stats.clone())
            .with_context(|| format!("cannot serve metrics on {addr}"))?;
    }
    tune_readahead(&plan.mountpoint, plan.options.read_ahead_kb);
    if let (crate::options::Warm::Raw, Some(cache)) = (plan.options.warm, prefetcher.node_cache().cloned()) {
        let (client, stats) = (prefetcher.client(), prefetcher.stats.clone());
        let (plan_options, epoch) = (plan.options.plan, plan.options.first_epoch);
        runtime.spawn(async move {
            match client.sample_table().await {
                Ok(table) => {
                    let order = crate::warm::plan_order(&table, plan_options, epoch);
                    crate::warm::warm(client, cache, Arc::new(table), order, stats).await;
                }
                Err(e) => tracing::warn!(error = %e, "warm=raw: cannot fetch the sample table; nothing warmed"),
            }
        });
    }
    Ok(())
}

/// Checks everything ([`plan`]), mounts and serves until unmounted (or SIGTERM/SIGINT, which unmount).
/// With `daemonize`, the process forks first, before anything starts a thread (the checks start a
/// runtime), and the command returns once the daemon's mount is ready, or fails with the daemon's
/// reason, checks included.
pub fn mount(url: &str, mountpoint: &Path, options: MountOptions, daemonize: bool) -> Result<()> {
    if let Some(start) = crate::supervise::WorkerStart::from_env()? {
        return work(url, options, start);
    }
    let mut ready = None;
    if daemonize {
        let (mut parent_end, child_end) = std::os::unix::net::UnixStream::pair()?;
        match sys::fork()? {
            sys::Forked::Parent => {
                drop(child_end);
                let mut message = String::new();
                parent_end.read_to_string(&mut message)?;
                return match message.strip_prefix("ok") {
                    Some(_) => Ok(()),
                    None if message.is_empty() => bail!("the mount daemon exited before the mount was ready"),
                    None => bail!("{}", message.trim()),
                };
            }
            sys::Forked::Child => {
                drop(parent_end);
                sys::detach()?;
                ready = Some(child_end);
            }
        }
    }
    let kept = crate::supervise::kept_by_systemd();
    let result = plan_at(url, mountpoint, options, !kept).and_then(|plan| match plan.options.supervise || kept {
        true => crate::supervise::supervise(&plan, fuser_config(&plan), ready.as_mut()),
        false => serve(&plan, ready.as_mut(), None),
    });
    if let (Err(e), Some(pipe)) = (&result, ready.as_mut()) {
        let _ = write!(pipe, "{e:#}");
    }
    result
}

/// A worker: serves the mount its supervisor holds until the mount ends (exit 0), or until SIGTERM asks
/// it to step down for a new worker ([`crate::supervise::EXIT_REPLACE`]).
fn work(url: &str, options: MountOptions, start: crate::supervise::WorkerStart) -> Result<()> {
    let http = http_config(url, &options)?;
    let plan = MountPlan {
        url: url.to_owned(),
        mountpoint: start.mountpoint.clone(),
        options,
        http,
        info: start.info.clone(),
    };
    serve(&plan, None, Some(start))
}

/// Serves `plan` until it is unmounted: mounted here, or, for a worker, the connection in `start`.
fn serve(
    plan: &MountPlan,
    ready: Option<&mut std::os::unix::net::UnixStream>,
    start: Option<crate::supervise::WorkerStart>,
) -> Result<()> {
    let energy = match &plan.options.energy_log {
        Some(path) => Some(
            batchfs_energy::EnergyLog::prepare(path)
                .with_context(|| format!("cannot write energy_log {}", path.display()))?,
        ),
        None => None,
    };
    let worker = start.is_some();
    let mounted = match start {
        Some(start) => {
            let mounted = take_over(plan, &start);
            match &mounted {
                Ok(_) => start.ready(),
                Err(e) => start.failed(e),
            }
            mounted?
        }
        None => spawn(plan)?,
    };
    let mountpoint = plan.mountpoint.clone();
    mounted.runtime().spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        if worker {
            // The supervisor holds the mount: this worker steps down for the next.
            tracing::info!("signal received: the worker steps down");
            std::process::exit(crate::supervise::EXIT_REPLACE);
        }
        tracing::info!("signal received: unmounting");
        let _ = sys::unmount(&mountpoint, true);
    });
    tracing::info!(mountpoint = %plan.mountpoint.display(), url = %plan.url, pid = std::process::id(), "serving");
    if let Some(pipe) = ready {
        let _ = pipe.write_all(b"ok");
        let _ = pipe.shutdown(std::net::Shutdown::Both);
    }
    let energy = energy.map(|log| {
        let stats = mounted.prefetcher.stats.clone();
        log.start(
            Duration::from_millis(100),
            Arc::new(move || stats.bytes_served.load(std::sync::atomic::Ordering::Relaxed)),
        )
    });
    mounted.wait()?;
    if let Some(log) = energy {
        log.finish(0.35).context("writing the energy log summary")?;
    }
    tracing::info!("unmounted");
    Ok(())
}
