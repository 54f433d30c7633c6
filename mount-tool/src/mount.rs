//! Mounting a [`MountPlan`]: the filesystem assembled on its runtime, mounted here (or, for a worker,
//! served on the connection its supervisor holds), daemonizing, tuning the kernel readahead, starting
//! what runs beside a mount (metrics, warming), and unmounting on a signal.

use crate::client::HttpClient;
use crate::fs::{Fs, FsOptions};
use crate::fuse::FuseFs;
use crate::node_cache::NodeCache;
use crate::options::MountOptions;
use crate::plan::{fuser_config, http_config, plan_at, MountPlan};
use crate::prefetch::{Prefetcher, PrefetcherConfig};
use crate::sys;
use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

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
    let config = PrefetcherConfig {
        index_id: plan.info.index_id.clone(),
        dataset: plan.http.dataset.clone(),
        ..PrefetcherConfig::from(&plan.options)
    };
    let prefetcher = Prefetcher::new(client, runtime.handle().clone(), config);
    prefetcher.stats.feed(move |s| s.servers = health.snapshot());
    if let Some(dir) = &plan.options.cache_dir {
        let (size, checks, namespace) =
            (plan.options.cache_dir_size, plan.options.cache_dir_checks, plan.http.cache_namespace());
        let cache = NodeCache::open_remembering(dir, size, checks, &namespace)
            .with_context(|| format!("cannot use cache_dir {}", dir.display()))?;
        prefetcher.use_node_cache(cache.clone());
        prefetcher.stats.feed(move |s| s.node_cache = Some(cache.snapshot()));
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
    let drop_page_cache = plan.options.page_cache == crate::options::PageCache::Drop;
    Ok((FuseFs::new(fs, plan.options.passthrough, drop_page_cache, plan.options.fuse_threads()), prefetcher))
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

/// The runtime a mount's fetches run on.
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
    let runtime = runtime()?;
    let (fs, prefetcher) = filesystem(plan, &runtime)?;
    let connection = fs.connection();
    let session = crate::plan::mount_alone(&plan.mountpoint, || {
        fuser::Session::new(fs, &plan.mountpoint, &fuser_config(plan)).with_context(|| crate::plan::cannot_mount(plan))
    })?;
    let _ = connection.notifier.set(session.notifier());
    let _ = connection.device.set(std::os::fd::AsFd::as_fd(&session).try_clone_to_owned()?);
    let session = session.spawn()?;
    serving(plan, &runtime, &prefetcher)?;
    Ok(Mounted { session: Some(session), runtime: Some(runtime), mountpoint: plan.mountpoint.clone(), prefetcher })
}

/// A worker's mount: serves the connection the supervisor holds (`start`), taking over from the worker
/// before it (`supervise.rs`), in background threads.
fn take_over(plan: &MountPlan, start: &crate::supervise::WorkerStart) -> Result<Mounted> {
    let runtime = runtime()?;
    let (fs, prefetcher) = filesystem(plan, &runtime)?;
    let connection = fs.connection();
    let ledger = start.ledger.clone();
    prefetcher.stats.feed(move |s| {
        let counters = ledger.counters();
        (s.supervisor_pid, s.worker_restarts, s.last_takeover_us) =
            (counters.supervisor_pid, counters.restarts, counters.last_takeover_us);
    });
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
    let _ = connection.notifier.set(session.notifier());
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

/// What starts once a mount serves: metrics, the kernel readahead, warming.
fn serving(plan: &MountPlan, runtime: &tokio::runtime::Runtime, prefetcher: &Arc<Prefetcher>) -> Result<()> {
    if let Some(addr) = plan.options.metrics {
        crate::metrics::serve(addr, prefetcher.stats.clone())
            .with_context(|| format!("cannot serve metrics on {addr}"))?;
    }
    tune_readahead(&plan.mountpoint, plan.options.read_ahead_kb);
    if let (crate::options::Warm::Raw, Some(cache)) = (plan.options.warm, prefetcher.node_cache().cloned()) {
        let (client, stats) = (prefetcher.client(), prefetcher.stats.clone());
        let (plan_options, epoch, timeout) = (plan.options.plan, plan.options.first_epoch, plan.options.timeout);
        let (dataset, mounted) = (plan.http.dataset.clone(), plan.info.index_id.clone());
        runtime.spawn(async move {
            match client.sample_table().await {
                Ok(table) => match crate::prefetch::changed(&dataset, &mounted, &table.index_id, "sample table") {
                    // Another index's samples are not the files this mount lists.
                    Some(e) => tracing::warn!(error = %e, "warm=raw: nothing warmed"),
                    None => {
                        let order = crate::warm::plan_order(&table, plan_options, epoch);
                        crate::warm::warm(client, cache, Arc::new(table), order, stats, timeout).await;
                    }
                },
                Err(e) => tracing::warn!(error = %e, "warm=raw: cannot fetch the sample table; nothing warmed"),
            }
        });
    }
    Ok(())
}

/// Checks everything ([`crate::plan::plan`]), mounts and serves until unmounted (or SIGTERM/SIGINT,
/// which unmount). With `daemonize`, the process forks first, before anything starts a thread (the checks
/// start a runtime), and the command returns once the daemon's mount is ready, or fails with the daemon's
/// reason, checks included.
pub fn mount(url: &str, mountpoint: &Path, options: MountOptions, daemonize: bool) -> Result<()> {
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

/// Why a FUSE session ended in error, with what to do where a thread could not be started (the session's
/// FUSE threads are started as it begins: `threads` beyond a pids limit, or short of memory, ends it).
fn session_failed(e: anyhow::Error, threads: usize) -> anyhow::Error {
    let io = e.chain().find_map(|c| c.downcast_ref::<std::io::Error>());
    match io.map(std::io::Error::kind) {
        Some(std::io::ErrorKind::WouldBlock | std::io::ErrorKind::OutOfMemory) => e.context(format!(
            "the FUSE session ended: a thread could not be started ({threads} FUSE threads; lower threads, or raise \
             the pids limit of the mount's cgroup)"
        )),
        _ => e.context("the FUSE session ended"),
    }
}

/// A worker: serves the mount its supervisor holds until the mount ends (exit 0), or until SIGTERM asks
/// it to step down for a new worker ([`crate::supervise::EXIT_REPLACE`]).
pub fn work(url: &str, mut options: MountOptions, start: crate::supervise::WorkerStart) -> Result<()> {
    if options.plan.shuffle == batchfs::plan::Shuffle::Blocks && start.block_bytes != 0 {
        // As the mount resolved it, not as this worker's command line leaves it (the first server's default).
        options.plan.block_bytes = start.block_bytes;
    }
    let http = match http_config(url, &options) {
        Ok(http) => http,
        Err(e) => {
            start.failed(&e);
            return Err(e);
        }
    };
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
        Some(path) => match batchfs_energy::EnergyLog::prepare(path) {
            Ok(log) => Some(log),
            Err(e) => {
                // A worker says why it cannot serve: its supervisor says so to whoever mounts.
                let e = anyhow::Error::new(e).context(format!("cannot write energy_log {}", path.display()));
                if let Some(start) = start {
                    start.failed(&e);
                }
                return Err(e);
            }
        },
        None => None,
    };
    let worker = start.is_some();
    // A worker's and a daemon's stderr is no one's (the supervisor's, or /dev/null): why they stop is logged.
    let unseen = worker || ready.is_some();
    let (mounted, start) = match start {
        Some(start) => match take_over(plan, &start) {
            Ok(mounted) => (mounted, Some(start)),
            Err(e) => {
                start.failed(&e);
                return Err(e);
            }
        },
        None => (spawn(plan)?, None),
    };
    let mountpoint = plan.mountpoint.clone();
    // The handlers are in place before a worker says it serves: a SIGTERM of an upgrade that came just
    // after ended the worker by its default (a failure that counted toward giving the mount up), where the
    // worker steps down.
    let (mut term, mut hup) = {
        use tokio::signal::unix::{signal, SignalKind};
        let _in = mounted.runtime().enter();
        (signal(SignalKind::terminate()).expect("signal"), signal(SignalKind::hangup()))
    };
    let serving = start.map(|start| start.ready());
    mounted.runtime().spawn(async move {
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = tokio::signal::ctrl_c() => break,
                // Its default killed the mount's only process, leaving the mountpoint "not connected".
                Some(()) = async { hup.as_mut().ok()?.recv().await } => tracing::warn!(
                    "SIGHUP ignored: upgrades go to a mount's supervisor (supervise=true, the default); \
                     SIGTERM unmounts"
                ),
            }
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
    if let Err(e) = mounted.wait().map_err(|e| session_failed(e, plan.options.fuse_threads())) {
        if unseen {
            tracing::error!(error = %format!("{e:#}"), "the mount stops serving");
        }
        if let Some(serving) = serving {
            serving.stopped(&e);
        }
        return Err(e);
    }
    if let Some(log) = energy {
        log.finish(0.35).context("writing the energy log summary")?;
    }
    tracing::info!("unmounted");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session ended by a thread it could not start says so, and what to do; another error says the
    /// session ended, with its cause.
    #[test]
    fn a_session_short_of_threads_says_what_to_do() {
        let joined = |errno| anyhow::Error::new(std::io::Error::from_raw_os_error(errno)).context("FUSE session");
        let e = format!("{:#}", session_failed(joined(libc::EAGAIN), 5_000));
        assert!(e.contains("a thread could not be started (5000 FUSE threads; lower threads"), "{e}");
        assert!(e.contains("pids limit") && e.contains("FUSE session: Resource temporarily unavailable"), "{e}");
        let e = format!("{:#}", session_failed(joined(libc::ENODEV), 4));
        assert!(e.starts_with("the FUSE session ended: FUSE session: No such device"), "{e}");
    }
}
