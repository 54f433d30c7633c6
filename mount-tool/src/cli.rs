//! The `batchfs` command line: `mount`, `umount`, `stats` (the lab tools are `batchfs-lab`'s); also
//! `mount.batchfs` (the helper mount(8) runs for fstab entries of type `batchfs`)
//! and `batchfs URL DIR -o ...` (how mount.fuse3 runs a `fuse.batchfs` entry).

use crate::options::{MountOptions, OptionFlags, MOST_THREADS};
use crate::stats::StatsSnapshot;
use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// batchfs: a read-only FUSE mount of pre-batched datasets served by batchfs-server.
#[derive(Debug, Parser)]
#[command(name = "batchfs", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Mount a dataset: `batchfs mount http://storage:7878/imagenet /mnt/imagenet -o batch_size=256`.
    /// `batchfs mount --upgrade DIR` replaces the worker serving the mount at DIR by the program installed
    /// now, without unmounting.
    Mount(Box<MountArgs>),
    /// Unmount a batchfs mount.
    Umount {
        mountpoint: PathBuf,
        /// Detach now, clean up when no longer busy.
        #[arg(long, short)]
        lazy: bool,
    },
    /// Fill a node cache with the files of a file-tree dataset, in batches: `batchfs warm
    /// /mnt/imagenet/raw/train` (a directory of a mount with a cache_dir: its files) or `batchfs warm
    /// http://storage:7878/imagenet -o cache_dir=/nvme/batchfs` (every file, no mount needed). Mounts with
    /// that cache_dir read it first.
    Warm {
        /// A directory of a batchfs mount (`raw/...` or `shuffled/CLASS`), or http(s)://host:port/DATASET
        target: String,
        /// Options as key=value[,key=value...]: cache_dir (required with a URL; a mount's own by default),
        /// cache_dir_size, seed, shuffle, first_epoch (the plan whose order it warms in), token_file,
        /// ca_file, connections, servers, stall_timeout, timeout, keepalive, frame_size; a mount's others refused
        #[arg(short = 'o', value_name = "OPTIONS")]
        options: Vec<String>,
    },
    /// Show a mount's live counters.
    Stats {
        mountpoint: PathBuf,
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct MountArgs {
    /// http(s)://host:port/DATASET
    pub url: String,
    pub mountpoint: PathBuf,
    /// Options as key=value[,key=value...] (every long flag below works here too).
    #[arg(short = 'o', value_name = "OPTIONS")]
    pub options: Vec<String>,
    /// Stay in the foreground (otherwise return once the mount is ready).
    #[arg(long, short)]
    pub foreground: bool,
    /// Samples per batch (the plan, shared with the server). [default: 256]
    #[arg(long, help_heading = "Plan", value_name = "N")]
    pub batch_size: Option<String>,
    /// The shuffle's seed. [default: 0]
    #[arg(long, help_heading = "Plan", value_name = "N")]
    pub seed: Option<String>,
    /// global, none or blocks (each object read once an epoch, block_bytes of objects at a time).
    /// [default: global]
    #[arg(long, help_heading = "Plan", value_name = "MODE")]
    pub shuffle: Option<String>,
    /// With shuffle=blocks: the most bytes of objects in use at once (default: the server's)
    #[arg(long, help_heading = "Plan", value_name = "SIZE")]
    pub block_bytes: Option<String>,
    /// Drop an epoch's partial last batch: `--drop-last` (on), or `--drop-last=off` to override `-o
    /// drop_last`. [default: off]
    #[arg(long, help_heading = "Plan", value_name = "on|off", num_args = 0..=1, require_equals = true,
        default_missing_value = "on")]
    pub drop_last: Option<String>,
    /// tfrecord (with .tfrecord.idx twins) or tar. [default: tfrecord]
    #[arg(long, help_heading = "Plan", value_name = "FORMAT")]
    pub format: Option<String>,
    #[command(flatten)]
    pub flags: OptionFlags,
}

impl MountArgs {
    /// The options: defaults, then `-o` lists, then long flags.
    pub fn mount_options(&self) -> Result<MountOptions> {
        let mut o = MountOptions::default();
        for list in &self.options {
            o.apply_list(list)?;
        }
        let plan = [
            ("batch_size", &self.batch_size),
            ("seed", &self.seed),
            ("shuffle", &self.shuffle),
            ("block_bytes", &self.block_bytes),
        ];
        for (key, value) in plan.into_iter().chain([("format", &self.format)]) {
            if let Some(v) = value {
                o.set(key, Some(v))?;
            }
        }
        if let Some(v) = &self.drop_last {
            o.set("drop_last", Some(v))?;
        }
        self.flags.apply(&mut o);
        Ok(o)
    }
}

/// Logs to `log_file` (appended; one that cannot be opened is an error, not a log lost: a daemonized
/// mount has no stderr to read), else to stderr, in colour only on a terminal.
fn init_tracing(log_file: Option<&Path>, default: &str) -> Result<()> {
    let file = match log_file {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("cannot open log_file {}", p.display()))?,
        ),
        None => None,
    };
    batchfs::process::init_logs(default, file);
    Ok(())
}

/// Entry point of the binary.
/// `batchfs mount ... --SWITCH VALUE ...`, a switch's value spaced from it as releases before took it,
/// joined into `--SWITCH=VALUE` where VALUE is a switch's word (`on`, `false`, ...): a switch now takes a
/// value only after `=` (so that `--allow-other URL DIR` leaves URL to the URL), and a supervisor starts
/// each worker, a new release's after an upgrade too, with the command line the mount was made with. Any
/// other word after a switch is the next argument.
fn join_switch_values(mut args: Vec<OsString>) -> Vec<OsString> {
    use clap::CommandFactory;
    if args.get(1).is_none_or(|a| a != "mount") {
        return args;
    }
    let command = Cli::command();
    let Some(mount) = command.find_subcommand("mount") else { return args };
    let switches: Vec<String> = mount
        .get_arguments()
        .filter(|a| a.is_require_equals_set())
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect();
    let mut at = 2;
    while at + 1 < args.len() {
        let word = args[at + 1].to_str().filter(|w| batchfs::units::parse_switch(w).is_ok());
        if let (Some(flag), Some(word)) = (args[at].to_str().filter(|f| switches.iter().any(|s| s == f)), word) {
            let joined = OsString::from(format!("{flag}={word}"));
            args.splice(at..at + 2, [joined]);
        }
        at += 1;
    }
    args
}

/// A kept mount's command line (a worker's, which its supervisor, of this release or one before, starts
/// with the command line the mount was made with; or that of a supervisor systemd started again with the
/// mount it stored), `threads` above [`MOST_THREADS`] lowered to it: releases before took any number,
/// and the refusal a new mount gets would leave such a mount without a worker after an upgrade. The
/// number given, where one was lowered, for a warning once the log is set up.
fn lower_kept_threads(args: &mut [OsString]) -> Option<usize> {
    let mut given = None;
    let mut lower = |value: &str| {
        let n = value.trim().parse::<usize>().ok().filter(|&n| n > MOST_THREADS)?;
        given = Some(n);
        Some(MOST_THREADS.to_string())
    };
    for at in 0..args.len() {
        let before = at.checked_sub(1).and_then(|b| args[b].to_str());
        let Some(arg) = args[at].to_str() else { continue };
        let lowered = match (before, arg) {
            (Some("--threads"), value) => lower(value),
            (_, a) if a.starts_with("--threads=") => lower(&a["--threads=".len()..]).map(|n| format!("--threads={n}")),
            (Some("-o"), list) => lower_in_list(list, &mut lower),
            (_, a) if a.starts_with("-o") => {
                // `-oLIST`, or `-o=LIST`, which clap takes too.
                let joined = if a.starts_with("-o=") { "-o=" } else { "-o" };
                lower_in_list(&a[joined.len()..], &mut lower).map(|list| format!("{joined}{list}"))
            }
            _ => None,
        };
        if let Some(lowered) = lowered {
            args[at] = lowered.into();
        }
    }
    given
}

/// A `-o` list with its `threads` value lowered by `lower`, if it was.
fn lower_in_list(list: &str, lower: &mut impl FnMut(&str) -> Option<String>) -> Option<String> {
    let mut lowered = false;
    let items: Vec<String> = list
        .split(',')
        .map(|item| match item.trim().strip_prefix("threads=").and_then(&mut *lower) {
            Some(n) => {
                lowered = true;
                format!("threads={n}")
            }
            None => item.to_owned(),
        })
        .collect();
    lowered.then(|| items.join(","))
}

pub fn run() -> Result<()> {
    // A mount's cached objects each hold a memory file (passthrough); its workers inherit the limit.
    batchfs::process::raise_open_files_limit();
    let mut args: Vec<OsString> = std::env::args_os().collect();
    let kept = std::env::var_os(crate::supervise::WORKER_ENV).is_some() || crate::supervise::kept_by_systemd();
    let lowered = if kept { lower_kept_threads(&mut args) } else { None };
    let program = args.first().and_then(|a| Path::new(a).file_name()).map(|n| n.to_string_lossy().into_owned());
    if program.as_deref().is_some_and(|p| p.starts_with("mount.batchfs") || p == "mount.fuse.batchfs") {
        return mount_helper(&args[1..], lowered);
    }
    // `batchfs URL DIR -o ...`, as mount.fuse3 runs the program of a `fuse.batchfs` entry.
    if args.get(1).and_then(|a| a.to_str()).is_some_and(|a| a.starts_with("http://") || a.starts_with("https://")) {
        args.insert(1, "mount".into());
    }
    // `batchfs mount --upgrade DIR`: the mount's supervisor replaces its worker by the program installed now.
    if args.get(1).is_some_and(|a| a == "mount") && args.get(2).is_some_and(|a| a == "--upgrade") {
        let Some(dir) = args.get(3).filter(|_| args.len() == 4) else { bail!("usage: batchfs mount --upgrade DIR") };
        return crate::supervise::upgrade(Path::new(dir));
    }
    let cli = Cli::parse_from(join_switch_values(args));
    match cli.command {
        Command::Mount(m) => {
            crate::sys::release_large_allocations();
            let options = m.mount_options()?;
            match init_tracing(if m.foreground { None } else { options.log_file.as_deref() }, "info") {
                // A worker replacing one after the log file's directory went away (or turned read-only):
                // the mount serves on, logging to the supervisor's stderr. The mount itself refuses it.
                Err(e) if std::env::var_os(crate::supervise::WORKER_ENV).is_some() => {
                    init_tracing(None, "info")?;
                    tracing::warn!("{e:#}: this worker logs to the supervisor's stderr");
                }
                tried => tried?,
            }
            mount(&m.url, &m.mountpoint, options, !m.foreground, lowered)
        }
        Command::Umount { mountpoint, lazy } => umount(&mountpoint, lazy),
        Command::Warm { target, options } => {
            init_tracing(None, "warn")?;
            let mut o = warm_options(&options)?;
            let (url, dir) = warm_target(&target, &mut o)?;
            let of_a_mount = !(target.starts_with("http://") || target.starts_with("https://"));
            let failed = crate::warm::command(&url, &dir, &o).map_err(|e| {
                // A mount's cache_dir is found through it; its token and CA file are not shown there.
                let hint = of_a_mount && o.token_file.is_none() && o.ca_file.is_none() && wants_credentials(&e);
                match hint {
                    true => e.context(format!(
                        "cannot warm from {url} (a mount's token_file and ca_file are not read from it: give \
                         them with -o token_file=...,ca_file=... where it uses them)"
                    )),
                    false => e.context(format!("cannot warm from {url}")),
                }
            })?;
            if failed > 0 {
                bail!("{failed} files could not be fetched (they are fetched on demand by the mounts)");
            }
            Ok(())
        }
        Command::Stats { mountpoint, json } => stats(&mountpoint, json),
    }
}

/// Whether `e` is a refusal a token or a CA file answers: the server's 401 or 403, or a TLS handshake
/// rustls refused (a certificate it does not trust).
fn wants_credentials(e: &anyhow::Error) -> bool {
    use crate::client::ClientError;
    e.chain().any(|c| match c.downcast_ref::<ClientError>() {
        Some(ClientError::Status { status: 401 | 403, .. }) => true,
        Some(ClientError::Unreachable { cause, .. }) => {
            std::iter::successors(Some(cause.as_ref() as &(dyn std::error::Error + 'static)), |s| s.source()).any(|s| {
                let io_inner = s.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref());
                io_inner.is_some_and(|i| i.is::<crate::client::HandshakeError>())
            })
        }
        _ => false,
    })
}

/// The options `batchfs warm` uses, as `-o` lists: one it has no use for (a mount's, such as `prefetch`)
/// is refused, not silently ignored.
pub const WARM_OPTIONS: [&str; 13] = [
    "cache_dir",
    "cache_dir_size",
    "seed",
    "shuffle",
    "first_epoch",
    "token_file",
    "ca_file",
    "connections",
    "servers",
    "stall_timeout",
    "timeout",
    "keepalive",
    "frame_size",
];

/// `batchfs warm`'s `-o` lists, parsed as a mount's; only [`WARM_OPTIONS`] taken.
fn warm_options(lists: &[String]) -> Result<MountOptions> {
    let mut o = MountOptions::default();
    for list in lists {
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let key = item.split_once('=').map_or(item, |(k, _)| k);
            if !WARM_OPTIONS.contains(&key) {
                bail!("batchfs warm does not use option {key:?} (it takes {})", WARM_OPTIONS.join(", "));
            }
        }
        o.apply_list(list)?;
    }
    Ok(o)
}

/// What `batchfs warm TARGET` warms: a URL's whole dataset, or, for a directory of a batchfs mount, that
/// mount's dataset (its source in the mount table) below the directory (`raw/SUB` or `shuffled/CLASS`: the
/// files of SUB or of CLASS; the mount's root or `raw/`: all), into the mount's own `cache_dir` unless one
/// is given.
fn warm_target(target: &str, options: &mut MountOptions) -> Result<(String, String)> {
    if target.starts_with("http://") || target.starts_with("https://") {
        return Ok((target.to_owned(), String::new()));
    }
    let dir = std::fs::canonicalize(target).with_context(|| format!("{target}: no such directory"))?;
    let mount = crate::plan::mount_table()
        .into_iter()
        .filter(|m| m.is_batchfs() && dir.starts_with(&m.point))
        .map(|m| (m.point, m.source))
        .max_by_key(|(point, _)| point.len());
    let Some((point, url)) = mount else { bail!("{} is not in a batchfs mount (give a URL instead)", dir.display()) };
    let rel = dir.strip_prefix(&point).unwrap_or(&dir).to_string_lossy().into_owned();
    let sub = match rel.split_once('/').unwrap_or((rel.as_str(), "")) {
        ("", _) => String::new(),
        (crate::fs::RAW_NAME, sub) | (crate::fs::SHUFFLED_NAME, sub) => sub.to_owned(),
        _ => bail!("{}: warm a directory of raw/ or shuffled/ (or the mount itself)", dir.display()),
    };
    if options.cache_dir.is_none() {
        let stats = std::fs::read(Path::new(&point).join(crate::fs::META_NAME).join("stats"))?;
        let s: StatsSnapshot = serde_json::from_slice(&stats).context("malformed stats")?;
        options.cache_dir = s.node_cache.map(|n| PathBuf::from(n.dir));
    }
    Ok((url, sub))
}

/// `mount.batchfs SPEC DIR [-sfnv] [-o OPTIONS] [-t TYPE]`, as mount(8) calls it.
fn mount_helper(args: &[OsString], lowered: Option<usize>) -> Result<()> {
    let mut positional = Vec::new();
    let mut options = MountOptions::default();
    let mut fake = false;
    let mut it = args.iter().map(|a| a.to_string_lossy().into_owned());
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-o" => options.apply_list(&it.next().context("-o needs a value")?)?,
            "-t" => {
                it.next();
            }
            "-f" => fake = true,
            "-s" | "-n" | "-v" => {}
            a if a.starts_with("-o") => options.apply_list(&a[2..])?,
            a if a.starts_with('-') => bail!("mount.batchfs: unknown flag {a}"),
            _ => positional.push(arg),
        }
    }
    let [spec, dir] = positional.as_slice() else {
        bail!("usage: mount.batchfs http://host:port/DATASET MOUNTPOINT [-o options]");
    };
    init_tracing(options.log_file.as_deref(), "info")?;
    crate::sys::release_large_allocations();
    if fake {
        // `mount -f`: every check, nothing mounted.
        return crate::plan::plan(spec, Path::new(dir), options).map(|_| ());
    }
    mount(spec, Path::new(dir), options, true, lowered)
}

/// Mounts, or, in a worker its supervisor started (with the same arguments: `supervise.rs`), serves the
/// supervisor's mount; `lowered`: the `threads` its command line gave, lowered ([`lower_kept_threads`]).
fn mount(url: &str, mountpoint: &Path, options: MountOptions, daemonize: bool, lowered: Option<usize>) -> Result<()> {
    if let Some(given) = lowered {
        tracing::warn!(
            "this mount was made with threads={given}, which a release before took: it runs {MOST_THREADS} FUSE \
             threads, the most a new mount takes"
        );
    }
    match crate::supervise::WorkerStart::from_env()? {
        Some(start) => crate::mount::work(url, options, start),
        None => crate::mount::mount(url, mountpoint, options, daemonize),
    }
}

/// How long `umount` tries again while the mount is busy: a file just closed keeps it busy until the
/// daemon has answered the close (the kernel sends `RELEASE` after `close` returns), which a loaded machine
/// may take a moment to do; a file still open keeps it busy past this.
const BUSY_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

fn umount(mountpoint: &Path, lazy: bool) -> Result<()> {
    // Only a batchfs mount: `batchfs umount` of another filesystem is a slip, not a wish. The path as given,
    // made absolute without looking at it (a dead mount cannot be looked at); the last mount at a place is
    // the one seen there.
    let at = std::path::absolute(mountpoint)?.to_string_lossy().trim_end_matches('/').to_owned();
    if let Some(m) = crate::plan::mount_table().into_iter().rev().find(|m| m.point == at) {
        if !m.is_batchfs() {
            bail!("{} is not a batchfs mount ({} from {}): use umount(8)", mountpoint.display(), m.fstype, m.source);
        }
    }
    let deadline = std::time::Instant::now() + BUSY_GRACE;
    let mut tried = crate::sys::unmount(mountpoint, lazy);
    while matches!(&tried, Err(e) if e.raw_os_error() == Some(libc::EBUSY)) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        tried = crate::sys::unmount(mountpoint, lazy);
    }
    tried.map_err(|e| match e.raw_os_error() {
        Some(libc::EINVAL) => anyhow::anyhow!("{} is not mounted", mountpoint.display()),
        Some(libc::EBUSY) => {
            anyhow::anyhow!("{} is busy (files open); use --lazy to detach it now", mountpoint.display())
        }
        _ => anyhow::anyhow!("cannot unmount {}: {e}", mountpoint.display()),
    })
}

fn stats(mountpoint: &Path, json: bool) -> Result<()> {
    let path = mountpoint.join(crate::fs::META_NAME).join("stats");
    let text =
        std::fs::read(&path).with_context(|| format!("cannot read {} (is this a batchfs mount?)", path.display()))?;
    if json {
        print!("{}", String::from_utf8_lossy(&text));
        return Ok(());
    }
    let s: StatsSnapshot = serde_json::from_slice(&text).context("malformed stats")?;
    print!("{}", format_stats(&s));
    Ok(())
}

/// A human table of the counters.
pub fn format_stats(s: &StatsSnapshot) -> String {
    // Daemon reads and passthrough opens each look their file up in the cache.
    let lookups = s.reads + s.passthrough_opens;
    let hit_rate = if lookups > 0 { 100.0 * s.hits as f64 / lookups as f64 } else { 0.0 };
    let path = match (s.passthrough, s.huge_pages) {
        (true, true) => "kernel passthrough (reads stay in the kernel), memory files of huge pages",
        (true, false) => "kernel passthrough (reads stay in the kernel), memory files of 4 KiB pages",
        (false, _) => "through the daemon",
    };
    let mut rows = vec![
        ("read path".to_owned(), path.to_owned()),
        ("bytes served".to_owned(), format!("{:.1} MB", s.bytes_served as f64 / 1e6)),
        ("reads".to_owned(), format!("{} ({} before their batch had all arrived)", s.reads, s.early_reads)),
        (
            "opens".to_owned(),
            format!(
                "{} passthrough, {} through the daemon ({} page caches dropped at close)",
                s.passthrough_opens, s.daemon_opens, s.page_cache_drops
            ),
        ),
        ("cache hits".to_owned(), format!("{} ({hit_rate:.1} %)", s.hits)),
        ("misses (on demand)".to_owned(), s.misses.to_string()),
        ("stalls".to_owned(), format!("{} ({:.3} s waiting)", s.stalls, s.stall_us as f64 / 1e6)),
        ("prefetches".to_owned(), s.prefetches.to_string()),
        ("in flight".to_owned(), s.in_flight.to_string()),
        (
            "prefetch window".to_owned(),
            format!(
                "{:.1} MB in flight, cap {:.1} MB, delivery {}",
                s.prefetch_bytes_in_flight as f64 / 1e6,
                s.prefetch_cap as f64 / 1e6,
                if s.delivery_rate > 0 {
                    format!("{:.0} MB/s", s.delivery_rate as f64 / 1e6)
                } else {
                    "not measured yet".to_owned()
                }
            ),
        ),
        (
            "worker".to_owned(),
            match s.supervisor_pid {
                0 => format!("pid {} (unsupervised)", s.worker_pid),
                sup => format!(
                    "pid {} under supervisor {sup}; {} takeovers (last {:.1} ms without service)",
                    s.worker_pid,
                    s.worker_restarts,
                    s.last_takeover_us as f64 / 1e3
                ),
            },
        ),
        ("cache bytes".to_owned(), format!("{:.1} MB", s.cache_bytes as f64 / 1e6)),
        ("fetched".to_owned(), format!("{:.1} MB", s.fetched_bytes as f64 / 1e6)),
        ("retries".to_owned(), s.retries.to_string()),
        ("checksum errors".to_owned(), s.checksum_errors.to_string()),
        ("errors".to_owned(), s.errors.to_string()),
        ("evictions".to_owned(), s.evictions.to_string()),
        (
            "node cache".to_owned(),
            match &s.node_cache {
                Some(n) => format!(
                    "{:.1} MB held; {} hits ({:.1} MB); {:.1} MB written; {} corrupt, {} evicted",
                    n.bytes as f64 / 1e6,
                    n.hits,
                    n.hit_bytes as f64 / 1e6,
                    n.written_bytes as f64 / 1e6,
                    n.corrupt,
                    n.evictions
                ),
                None => "none (cache_dir)".to_owned(),
            },
        ),
    ];
    if s.shuffled_window > 0 {
        rows.push(("shuffled/ windows".to_owned(), format!("{} groups ahead of each class", s.shuffled_window)));
    }
    for (i, v) in s.servers.iter().enumerate() {
        let state = match (v.up, v.other_index) {
            (_, true) => "serves another index of the dataset (passed over; probed again later)",
            (true, false) => "in rotation",
            (false, false) => "out (failed; probed after its backoff)",
        };
        rows.push((
            format!("server {i}"),
            format!(
                "{} {state}: {} requests, {} failures, {} shed, {:.1} MB, {} MB/s, {:.1} MB in flight, out {} times",
                v.url,
                v.requests,
                v.failures,
                v.sheds,
                v.bytes as f64 / 1e6,
                v.mb_per_s,
                v.in_flight_bytes as f64 / 1e6,
                v.taken_out
            ),
        ));
    }
    if let Some(w) = &s.warm {
        let rate = w.bytes as f64 / w.seconds.max(1) as f64;
        let eta = if rate > 0.0 {
            format!("{:.0} s", w.bytes_total.saturating_sub(w.bytes) as f64 / rate)
        } else {
            "—".into()
        };
        let done = if w.files >= w.files_total { "done".to_owned() } else { format!("ETA {eta}") };
        rows.push((
            "warm".to_owned(),
            format!(
                "{}/{} files, {:.1}/{:.1} MB, {:.0} MB/s, {done}",
                w.files,
                w.files_total,
                w.bytes as f64 / 1e6,
                w.bytes_total as f64 / 1e6,
                rate / 1e6
            ),
        ));
    }
    rows.iter().map(|(k, v)| format!("{k:<20} {v}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `batchfs warm` of a mount's directory says that the mount's token and CA file are not read from it
    /// where they would answer the error (401, 403, a TLS handshake refused), not at every error.
    #[test]
    fn warm_s_credentials_hint_is_for_refusals_only() {
        use crate::client::{ClientError, HandshakeError};
        let status = |status| ClientError::Status { server: "s".into(), status, message: "no".into() };
        let refused = anyhow::Error::new(status(401)).context("cannot describe the dataset");
        assert!(wants_credentials(&refused));
        assert!(wants_credentials(&anyhow::Error::new(status(403))));
        let tls = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            HandshakeError(rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer)),
        );
        assert!(wants_credentials(&anyhow::Error::new(ClientError::unreachable("s", tls))));
        let down = ClientError::unreachable("s", std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(!wants_credentials(&anyhow::Error::new(down)));
        assert!(!wants_credentials(&anyhow::Error::new(status(404))));
        assert!(!wants_credentials(&anyhow::anyhow!("batchfs warm warms a file tree's files")));
    }

    /// `--drop-last` is on, and `--drop-last=off` overrides `-o drop_last` as other long flags override
    /// their key in `-o` (it took no value: a flag could not turn it off).
    #[test]
    fn drop_last_s_flag_turns_it_on_or_off_over_the_option() {
        let drop_last = |args: &[&str]| {
            let base = ["batchfs", "mount"];
            let rest = ["http://s:1/d", "/mnt/d"];
            let cli = Cli::try_parse_from(base.iter().chain(args).chain(&rest)).unwrap();
            let Command::Mount(m) = cli.command else { panic!("not a mount") };
            m.mount_options().unwrap().plan.drop_last
        };
        assert!(drop_last(&["--drop-last"]));
        assert!(drop_last(&["-o", "drop_last"]));
        assert!(!drop_last(&["-o", "drop_last", "--drop-last=off"]));
        assert!(!drop_last(&[]));
    }

    /// A switch given alone is on wherever it sits, before the URL too (it took the URL as its value), and
    /// `--x=false` or `--x=off` still turns it off.
    #[test]
    fn a_switch_alone_is_on_and_leaves_the_next_argument_alone() {
        let options = |args: &[&str]| {
            let cli = Cli::try_parse_from(["batchfs", "mount"].iter().chain(args)).unwrap_or_else(|e| panic!("{e}"));
            let Command::Mount(m) = cli.command else { panic!("not a mount") };
            assert_eq!((m.url.as_str(), m.mountpoint.as_path()), ("http://s:1/d", Path::new("/mnt/d")), "{args:?}");
            m.mount_options().unwrap()
        };
        let switches =
            ["allow-other", "auto-unmount", "passthrough", "huge-pages", "fuse-uring", "supervise", "resend"];
        for (first, rest) in [(true, false), (false, true)] {
            let mut args: Vec<String> = switches.iter().map(|s| format!("--{s}")).collect();
            if rest {
                args.insert(0, "--drop-last".into());
            }
            let at = if first { args.len() } else { 0 };
            args.splice(at..at, ["http://s:1/d".to_owned(), "/mnt/d".to_owned()]);
            let o = options(&args.iter().map(String::as_str).collect::<Vec<_>>());
            assert!(o.allow_other && o.auto_unmount && o.passthrough && o.huge_pages, "{args:?}");
            assert!(o.fuse_uring && o.supervise && o.resend && o.plan.drop_last == rest, "{args:?}");
        }
        let mut args: Vec<String> = switches.iter().map(|s| format!("--{s}=false")).collect();
        args[0] = "--allow-other=off".into();
        args.extend(["--drop-last=off".to_owned(), "http://s:1/d".to_owned(), "/mnt/d".to_owned()]);
        let o = options(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(!(o.allow_other || o.auto_unmount || o.passthrough || o.huge_pages || o.plan.drop_last));
        assert!(!(o.fuse_uring || o.supervise || o.resend));
        let e = Cli::try_parse_from(["batchfs", "mount", "--allow-other=maybe", "http://s:1/d", "/mnt/d"]);
        assert!(e.is_err(), "a switch's value still checked");
        // As releases before took them (a worker started after an upgrade gets the mount's command line):
        // a switch's word spaced from it is its value.
        let spaced = ["batchfs", "mount", "--passthrough", "false", "--drop-last", "on", "--allow-other"];
        let args: Vec<OsString> = spaced.iter().chain(&["http://s:1/d", "/mnt/d"]).map(OsString::from).collect();
        let Command::Mount(m) = Cli::try_parse_from(join_switch_values(args)).unwrap().command else { panic!() };
        let o = m.mount_options().unwrap();
        assert!(!o.passthrough && o.plan.drop_last && o.allow_other, "{o:?}");
    }

    /// A kept mount's command line, as a release that took any number of threads made it: `threads` above
    /// the most lowered to it, in every form the command line takes it, and nothing else touched.
    #[test]
    fn a_kept_mount_s_threads_above_the_most_are_lowered_to_it() {
        let lowered = |args: &[&str]| {
            let mut args: Vec<OsString> = args.iter().map(OsString::from).collect();
            let given = lower_kept_threads(&mut args);
            (args.iter().map(|a| a.to_str().unwrap().to_owned()).collect::<Vec<_>>(), given)
        };
        let most = MOST_THREADS.to_string();
        let (args, given) = lowered(&["batchfs", "mount", "-o", "batch_size=8, threads=5000,seed=1", "u", "d"]);
        assert_eq!((args[3].as_str(), given), (format!("batch_size=8,threads={most},seed=1").as_str(), Some(5000)));
        let (args, given) =
            lowered(&["batchfs", "mount", "-othreads=2000", "-o=threads=2500", "--threads", "3000", "--threads=4000"]);
        assert_eq!(
            args[2..],
            [
                format!("-othreads={most}"),
                format!("-o=threads={most}"),
                "--threads".into(),
                most.clone(),
                format!("--threads={most}")
            ]
        );
        assert_eq!(given, Some(4000), "the last one given is the mount's");
        let within = ["mount.batchfs", "u", "d", "-o", "threads=1024,seed=5000", "--threads=auto", "--seed", "5000"];
        assert_eq!(lowered(&within), (within.map(str::to_owned).to_vec(), None), "nothing above the most");
        let (args, _) = lowered(&["batchfs", "mount", "-o", "threads=5000", "http://s:1/d", "/mnt/d"]);
        let Command::Mount(m) =
            Cli::try_parse_from(join_switch_values(args.iter().map(OsString::from).collect())).unwrap().command
        else {
            panic!()
        };
        assert_eq!(m.mount_options().unwrap().fuse_threads(), MOST_THREADS);
    }

    /// The plan's long flags say the defaults the core plans with (they are not clap defaults: a flag
    /// given overrides `-o`, one left out must not).
    #[test]
    fn mount_help_says_the_plan_s_defaults() {
        let mut cli = Cli::command();
        let help = cli.find_subcommand_mut("mount").unwrap().render_long_help().to_string();
        let plan = batchfs::plan::PlanOptions::default();
        let format = MountOptions::default().format;
        for (flag, default) in [
            ("--batch-size", plan.batch_size.to_string()),
            ("--seed", plan.seed.to_string()),
            ("--shuffle", plan.shuffle.to_string()),
            ("--drop-last", if plan.drop_last { "on" } else { "off" }.to_owned()),
            ("--format", format.as_str().to_owned()),
        ] {
            let at = help.find(flag).unwrap_or_else(|| panic!("{flag} not in the help"));
            let entry = &help[at..];
            let entry = &entry[..entry[2..].find("\n      --").map_or(entry.len(), |end| end + 2)];
            assert!(entry.contains(&format!("[default: {default}]")), "{flag}: {entry}");
        }
    }

    #[test]
    fn warm_takes_the_options_it_uses_and_refuses_a_mount_s() {
        let o = warm_options(&["cache_dir=/nvme/c,seed=7".into(), "first_epoch=2".into()]).unwrap();
        assert_eq!((o.plan.seed, o.first_epoch), (7, 2));
        for mount_s in ["cache_dir=/c,prefetch=4", "batch_size=64", "allow_other"] {
            let e = warm_options(&[mount_s.into()]).unwrap_err().to_string();
            assert!(e.contains("does not use option"), "{mount_s}: {e}");
        }
        assert!(warm_options(&["seed=x".into()]).is_err(), "a value still checked");
    }
}
