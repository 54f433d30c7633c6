//! The mount plan: a mount's options, mountpoint and server checked before anything is mounted (so that
//! errors reach the terminal, or the CSI plugin as codes), and the FUSE session's settings that follow
//! from it. What the mount, its supervisor and the CSI plugin start from; it knows none of them.

use crate::client::{parse_url, BatchClient, ClientError, HttpClient, HttpConfig};
use crate::options::MountOptions;
use crate::sys;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    // Each server once: a repeat (the URL's own server in `servers=`) would be a "replica" that fails
    // over to itself, with connections of its own.
    let mut servers = vec![base];
    for server in &options.servers {
        if !servers.contains(server) {
            servers.push(server.clone());
        }
    }
    Ok(HttpConfig {
        servers,
        dataset,
        query: options.query(),
        token,
        connections: options.connections,
        ca_file: options.ca_file.clone(),
        stall_timeout: options.stall_timeout,
        keepalive: options.keepalive,
        connect_timeout: Duration::from_secs(10),
        frame_size: options.frame_size,
    })
}

/// Checks the options, the mountpoint (cleaning up a stale mount left by a killed daemon) and the
/// server (reachable, dataset known, token accepted) before mounting.
pub fn plan(url: &str, mountpoint: &Path, options: MountOptions) -> Result<MountPlan> {
    plan_at(url, mountpoint, options, true)
}

/// [`plan`]; without `check_mountpoint`, the mountpoint is taken as it is (a mount systemd kept for a
/// supervisor to take over: no worker answers there yet, so looking into it would wait for ever).
pub(crate) fn plan_at(
    url: &str,
    mountpoint: &Path,
    options: MountOptions,
    check_mountpoint: bool,
) -> Result<MountPlan> {
    let http = http_config(url, &options)?;
    if options.auto_unmount && !options.allow_other {
        // fusermount3, which unmounts once the process is gone, demands it.
        bail!("auto_unmount needs allow_other (fusermount3 unmounts for a mount others may read)");
    }
    if options.fuse_uring && options.supervise {
        // Linux re-sends to a new worker what a dead one had read from /dev/fuse (FUSE_NOTIFY_RESEND),
        // never what a ring's entries held: a takeover would leave those reads waiting for good.
        bail!("fuse_uring=on needs supervise=false: requests a dead worker's rings held are never re-sent");
    }
    if options.plan.block_bytes != 0 && options.plan.shuffle != batchfs::plan::Shuffle::Blocks {
        // It sizes `blocks`' working set and nothing else: taken without a word, it read as if it applied.
        bail!("block_bytes applies to shuffle=blocks only (shuffle={})", options.plan.shuffle);
    }
    if options.first_epoch + options.epochs > batchfs::plan::MAX_EPOCH + 1 {
        bail!(
            "first_epoch={} with epochs={} runs past epoch {}, the last a plan has",
            options.first_epoch,
            options.epochs,
            batchfs::plan::MAX_EPOCH
        );
    }
    let mountpoint = match check_mountpoint {
        true => prepare_mountpoint(mountpoint)?,
        false => std::fs::canonicalize(mountpoint).with_context(|| format!("mountpoint {}", mountpoint.display()))?,
    };
    let (info, block_bytes) = probe(&http, &options)?;
    if options.plan.drop_last && info.samples < u64::from(options.plan.batch_size) {
        // Every epoch would list no batch (its one partial batch dropped): a job that reads nothing.
        bail!(
            "drop_last with batch_size={} drops every epoch's only batch: dataset {:?} has {} samples",
            options.plan.batch_size,
            info.name,
            info.samples
        );
    }
    // `shuffle=blocks` without `block_bytes` takes the first server's default (a quarter of its disk tier,
    // or of its memory), and every server is asked for that: each server's own default would plan other
    // epochs, and a replica's bodies would not be the batches the manifest lists.
    let (options, http) = match block_bytes {
        Some(bytes) if options.plan.shuffle == batchfs::plan::Shuffle::Blocks && options.plan.block_bytes == 0 => {
            let mut resolved = options;
            resolved.plan.block_bytes = bytes;
            let http = http_config(url, &resolved)?;
            (resolved, http)
        }
        _ => (options, http),
    };
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

/// What a failed mount at `plan`'s mountpoint says: as a user other than root, also what mounting needs.
pub fn cannot_mount(plan: &MountPlan) -> String {
    let at = format!("cannot mount at {}", plan.mountpoint.display());
    match sys::is_root() {
        // Even as root, fuser mounts by fusermount3 where it must unmount when the process goes (its "No
        // such file or directory" named neither).
        true if plan.options.auto_unmount => {
            format!("{at} (auto_unmount mounts by fusermount3, which must be on the PATH: the fuse3 package)")
        }
        true => at,
        false => format!("{at} (as a user other than root, mounting takes fusermount3 on the PATH: the fuse3 package)"),
    }
}

/// Whether something is mounted at `path` (as `/proc/self/mountinfo` names it: canonical).
pub fn is_mountpoint(path: &Path) -> bool {
    let target = path.to_string_lossy();
    mount_table().iter().any(|m| m.point == target)
}

/// Whether the mount on top at `path` (canonical) is a batchfs mount: `None` where nothing is mounted.
pub fn batchfs_mounted_at(path: &Path) -> Option<bool> {
    let target = path.to_string_lossy();
    mount_table().iter().rev().find(|m| m.point == target).map(MountEntry::is_batchfs)
}

/// A mount, as `/proc/self/mountinfo` lists it.
pub(crate) struct MountEntry {
    /// Its mount point (spaces unescaped).
    pub point: String,
    pub fstype: String,
    pub source: String,
}

impl MountEntry {
    /// `fuse.batchfs`, or plain `fuse` from a build before it said its subtype mounting as root: the source
    /// (the dataset's URL) says it is ours.
    pub fn is_batchfs(&self) -> bool {
        let url = self.source.starts_with("http://") || self.source.starts_with("https://");
        self.fstype == "fuse.batchfs" || (self.fstype == "fuse" && url)
    }
}

/// Every mount of this process's namespace, in the order mounted (empty where the table cannot be read).
pub(crate) fn mount_table() -> Vec<MountEntry> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    // `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER_OPTIONS`.
    let entry = |line: &str| {
        let (left, right) = line.split_once(" - ")?;
        let point = left.split(' ').nth(4)?.replace("\\040", " ");
        let mut right = right.split(' ');
        Some(MountEntry { point, fstype: right.next()?.to_owned(), source: right.next()?.to_owned() })
    };
    text.lines().filter_map(entry).collect()
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
        return Err(busy(&path));
    }
    if let Some(first) = first_entry(&path) {
        // fuse3 mounts over a directory that holds files (libfuse 2 asked for `nonempty`): they are hidden,
        // not lost, until the unmount. Said, not refused: a mountpoint of kept files is a choice one can make.
        tracing::warn!(
            mountpoint = %path.display(),
            first = ?first,
            "the mountpoint is not empty: its files are hidden while batchfs is mounted over them, and come back \
             at the unmount"
        );
    }
    Ok(path)
}

fn busy(path: &Path) -> anyhow::Error {
    // `batchfs umount` unmounts batchfs mounts only.
    let how = if batchfs_mounted_at(path) == Some(false) { "umount" } else { "batchfs umount" };
    anyhow::anyhow!("{} is busy: something is already mounted there ({how} {} first)", path.display(), path.display())
}

/// Makes a mount at `mountpoint` (canonical) by `make`, none being there: the directory locked meanwhile
/// (`flock`), and looked at again under the lock. The plan looked before it asked the server, a while
/// before the mount is made: two mounts started together at one directory both found it free, both
/// mounted, one over the other.
pub(crate) fn mount_alone<T>(mountpoint: &Path, make: impl FnOnce() -> Result<T>) -> Result<T> {
    // Looked at first: a mount there (the other one's, which won) is not opened (its root would wait on
    // its daemon).
    if is_mountpoint(mountpoint) {
        return Err(busy(mountpoint));
    }
    // A directory that may be searched but not read (mode 711) cannot be opened to lock: mounted on
    // without the lock, as before it.
    let dir = match std::fs::File::open(mountpoint) {
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => None,
        dir => Some(dir.with_context(|| format!("mountpoint {}", mountpoint.display()))?),
    };
    if let Some(dir) = &dir {
        let until = std::time::Instant::now() + LOCK_WAIT;
        loop {
            match dir.try_lock() {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < until => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(std::fs::TryLockError::WouldBlock) => bail!(
                    "the mountpoint {} has been locked by another process for {LOCK_WAIT:?} (flock: another mount \
                     being made there, or a script's lock)",
                    mountpoint.display()
                ),
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("cannot lock the mountpoint {}", mountpoint.display()))
                }
            }
        }
    }
    if is_mountpoint(mountpoint) {
        return Err(busy(mountpoint));
    }
    // The lock goes with `dir`, once the mount is made (or failed).
    make()
}

/// The longest [`mount_alone`] waits for another's lock of the mountpoint (another mount being made there
/// takes a moment; a lock held longer is someone else's).
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The name of an entry of directory `dir`, if it holds any (none where it cannot be listed).
fn first_entry(dir: &Path) -> Option<std::ffi::OsString> {
    std::fs::read_dir(dir).ok()?.flatten().next().map(|e| e.file_name())
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
    #[error("cannot reach or talk to the server")]
    Unreachable { source: ClientError },
}

/// Checks that the server of `url` serves its dataset with `options` (reachable, dataset known, token
/// accepted, plan valid, cache large enough), as a mount does before mounting; a [`Refused`] error says
/// which of these failed.
pub fn check(url: &str, options: &MountOptions) -> Result<batchfs::api::DatasetInfo> {
    probe(&http_config(url, options)?, options).map(|(info, _)| info)
}

/// [`check`]: the dataset's description, and the `block_bytes` the first server planned with (its own
/// default where the options leave it out).
fn probe(http: &HttpConfig, options: &MountOptions) -> Result<(batchfs::api::DatasetInfo, Option<u64>)> {
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
    // Each of `servers=` that answers must serve the same dataset: one that lacks it, or holds other
    // data under its name, would fail or refuse the reads routed to it.
    let replicas = match &result {
        Ok((info, _)) => runtime.block_on(check_replicas(http, info)),
        Err(_) => Ok(()),
    };
    // Join the runtime's threads now: a daemonizing caller forks next.
    runtime.shutdown_timeout(Duration::from_secs(5));
    replicas?;
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
    Ok((info, manifests.first().map(|m| m.options.block_bytes)))
}

/// Checks each server of `servers=` against `info`, the first server's description of the dataset: one
/// that does not know it, refuses the token, or describes other data (samples, bytes, shards, classes)
/// is refused; one that does not answer now is logged and kept (it may come up later: reads fail over).
async fn check_replicas(http: &HttpConfig, info: &batchfs::api::DatasetInfo) -> Result<()> {
    for server in &http.servers[1..] {
        let client = HttpClient::new(HttpConfig { servers: vec![server.clone()], ..http.clone() })?;
        let (server, dataset) = (server.clone(), http.dataset.clone());
        match client.dataset().await {
            Ok(other) => {
                let same = |i: &batchfs::api::DatasetInfo| (i.format, i.samples, i.bytes, i.shards, i.classes.clone());
                // Files of one count and size but other contents: another index id (where both say one).
                let other_files =
                    !info.index_id.is_empty() && !other.index_id.is_empty() && other.index_id != info.index_id;
                if same(&other) != same(info) || other_files {
                    bail!(
                        "{server} (servers=) holds other data as dataset {dataset:?}: {} samples of {} bytes in {} \
                         shards (index {}), where {} has {} samples of {} bytes in {} (index {})",
                        other.samples,
                        other.bytes,
                        other.shards,
                        other.index_id,
                        http.servers[0],
                        info.samples,
                        info.bytes,
                        info.shards,
                        info.index_id
                    );
                }
            }
            Err(e @ ClientError::Status { status: 404, .. }) => {
                return Err(Refused::UnknownDataset { dataset, server, source: e }).context("a server of servers=");
            }
            Err(e @ ClientError::Status { status: 401, .. }) => {
                return Err(Refused::Token { server, source: e }).context("a server of servers=");
            }
            Err(e) => tracing::warn!(%server, error = %e, "a server of servers= does not answer now: kept"),
        }
    }
    Ok(())
}

/// The FUSE session's settings for `plan`.
pub fn fuser_config(plan: &MountPlan) -> fuser::Config {
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
    config.n_threads = Some(plan.options.fuse_threads());
    config.clone_fd = true;
    // FUSE rings (`fuse_uring`) start with the FUSE threads' number, spread over the CPUs.
    config.io_uring_threads = plan.options.fuse_uring.then_some(plan.options.fuse_threads());
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `servers=` naming the URL's own server, or one twice, adds no "replica" that fails over to itself.
    #[test]
    fn each_server_is_routed_to_once() {
        let mut o = MountOptions::default();
        o.apply_list("servers=http://h:1;http://h:1/;http://g:2;http://g:2").unwrap();
        assert_eq!(http_config("http://h:1/d", &o).unwrap().servers, ["http://h:1", "http://g:2"]);
    }

    /// Why `plan_at` refuses a mount with the options `list`, before it looks at a server.
    fn refusal(list: &str) -> String {
        let mut options = MountOptions::default();
        options.apply_list(list).unwrap();
        match plan_at("http://127.0.0.1:9/d", Path::new("/nonexistent"), options, false) {
            Ok(_) => panic!("{list} was planned"),
            Err(e) => format!("{e:#}"),
        }
    }

    /// What [`prepare_mountpoint`] logs for `dir` (it takes it).
    fn prepared_logging(dir: &Path) -> String {
        let log = tempfile::NamedTempFile::new().unwrap();
        let file = log.reopen().unwrap();
        let subscriber =
            tracing_subscriber::fmt().with_ansi(false).with_writer(move || file.try_clone().unwrap()).finish();
        let prepared = tracing::subscriber::with_default(subscriber, || prepare_mountpoint(dir).unwrap());
        assert_eq!(prepared, std::fs::canonicalize(dir).unwrap());
        std::fs::read_to_string(log.path()).unwrap()
    }

    /// A mountpoint holding files is mounted over (fuse3's way), not refused, and the mount says that it
    /// hides them (it did without a word).
    #[test]
    fn a_mountpoint_that_holds_files_is_taken_with_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(prepared_logging(dir.path()), "");
        std::fs::write(dir.path().join("kept.txt"), b"mine").unwrap();
        let log = prepared_logging(dir.path());
        assert!(log.contains("WARN") && log.contains("the mountpoint is not empty"), "{log}");
        assert!(log.contains("first=\"kept.txt\""), "{log}");
    }

    /// A mountpoint busy with another filesystem is refused saying to unmount it with `umount` (it said
    /// `batchfs umount`, which refuses filesystems not its own).
    #[test]
    fn a_mountpoint_busy_with_another_filesystem_says_to_unmount_it_with_umount() {
        if !crate::sys::is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let ok = std::process::Command::new("mount").args(["-t", "tmpfs", "tmpfs"]).arg(dir.path()).status();
        if !ok.is_ok_and(|s| s.success()) {
            return;
        }
        let _unmount = UnmountOnDrop(dir.path().to_owned());
        let err = prepare_mountpoint(dir.path()).unwrap_err().to_string();
        assert!(err.contains("is busy") && err.contains("(umount "), "{err}");
    }

    #[test]
    fn fuse_rings_are_refused_under_a_supervisor() {
        let e = refusal("fuse_uring=on");
        assert!(e.contains("fuse_uring=on needs supervise=false"), "{e}");
    }

    /// `auto_unmount` without `allow_other` is refused in the mount's own words (fuser's were "auto_unmount
    /// requires acl != Owner").
    #[test]
    fn auto_unmount_without_allow_other_is_refused_saying_what_it_needs() {
        let e = refusal("auto_unmount");
        assert!(e.contains("auto_unmount needs allow_other"), "{e}");
    }

    /// `block_bytes` without `shuffle=blocks` sizes nothing: refused, not taken without a word.
    #[test]
    fn block_bytes_without_blocks_is_refused() {
        let e = refusal("block_bytes=4G");
        assert!(e.contains("block_bytes applies to shuffle=blocks only (shuffle=global)"), "{e}");
        let e = refusal("shuffle=none,block_bytes=4G");
        assert!(e.contains("(shuffle=none)"), "{e}");
    }

    /// The server's plans end at epoch 999,999: a job that would read past it is refused at the mount, not
    /// with a server's 400 at its last epochs' reads.
    #[test]
    fn a_job_whose_epochs_run_past_the_last_is_refused() {
        let e = refusal("first_epoch=999999,epochs=2");
        assert!(e.contains("first_epoch=999999 with epochs=2 runs past epoch 999999"), "{e}");
    }
}
