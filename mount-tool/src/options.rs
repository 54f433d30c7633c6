//! Mount options, each declared once (the `options!` table below): its field, its default, its parser, its
//! default as shown in `--help` and in docs/CONFIGURATION.md (a test keeps the three in step), its
//! placeholder and its help. Every one works as `-o key=value` (fstab style) and as a long flag. The plan
//! options (`batch_size`, `seed`, `shuffle`, `drop_last`, `format`) are the core's, parsed as the server
//! parses them in a query ([`BatchQuery::set`]).

use batchfs::api::BatchQuery;
use batchfs::encode::BatchFormat;
use batchfs::plan::PlanOptions;
use std::path::PathBuf;
use std::time::Duration;

/// How `rolling/` lays out TFRecord batches (the `rolling` mount option).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RollingMode {
    /// Each reader its layout: indexed for processes that opened a twin, packed for the others.
    #[default]
    Auto,
    /// Every reader the indexed layout.
    Indexed,
    /// Every reader the packed layout (twins per epoch).
    Packed,
}

/// What the mount fetches into its node cache on its own (`warm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Warm {
    /// Nothing: objects are kept as readers fetch them.
    None,
    /// Every file of the dataset (a file tree's samples), in batches, once mounted.
    Raw,
}

/// Base URLs of servers (an alias, so that the flag takes one `;`-separated value, as `-o` does).
pub type Urls = Vec<String>;

/// Whether a file read through the daemon leaves the kernel page cache at its last close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageCache {
    Drop,
    Keep,
}

/// The parsers of option values (each also a clap value parser): the reason a value is refused
/// ([`Refusal`]) is the message clap shows and [`OptionError::Value`] carries.
mod value {
    use super::{PageCache, Refusal, RollingMode};
    use std::path::PathBuf;

    pub fn count(v: &str) -> Result<u64, Refusal> {
        v.parse().map_err(|_| Refusal::Expected("a number"))
    }

    /// A count of at least one (0 was taken as 1 without a word).
    pub fn at_least_one(v: &str) -> Result<usize, Refusal> {
        match count(v)? as usize {
            0 => Err(Refusal::Expected("a number of at least 1")),
            n => Ok(n),
        }
    }

    /// The node cache's size: more than nothing (a cache that keeps nothing is no `cache_dir`).
    pub fn disk_size(v: &str) -> Result<u64, Refusal> {
        match size(v)? {
            0 => Err(Refusal::Expected("a size above 0 (leave cache_dir out for no node cache)")),
            n => Ok(n),
        }
    }

    /// `auto` ([`super::AUTO_THREADS`]) or a count from 1 to [`super::MOST_THREADS`].
    pub fn threads(v: &str) -> Result<usize, Refusal> {
        match v {
            "auto" => Ok(super::AUTO_THREADS),
            _ => match at_least_one(v) {
                Ok(n) if n <= super::MOST_THREADS => Ok(n),
                _ => Err(Refusal::Threads),
            },
        }
    }

    pub fn batches(v: &str) -> Result<usize, Refusal> {
        Ok(count(v)? as usize)
    }

    pub fn kb(v: &str) -> Result<u32, Refusal> {
        u32::try_from(count(v)?).map_err(|_| Refusal::TooLarge)
    }

    pub fn epoch(v: &str) -> Result<u64, Refusal> {
        let e = count(v)?;
        if e > batchfs::plan::MAX_EPOCH {
            return Err(Refusal::Epoch);
        }
        Ok(e)
    }

    /// How many epochs a job reads: at least one, and no more than a plan numbers.
    pub fn epochs(v: &str) -> Result<u64, Refusal> {
        match count(v)? {
            n @ 1..=EPOCHS => Ok(n),
            _ => Err(Refusal::Span),
        }
    }

    /// Epochs a plan numbers (0 to `MAX_EPOCH`).
    const EPOCHS: u64 = batchfs::plan::MAX_EPOCH + 1;

    pub fn size(v: &str) -> Result<u64, Refusal> {
        Ok(batchfs::units::parse_size(v)?)
    }

    /// An HTTP/2 frame size: 16K to 16M-1, as the protocol allows.
    pub fn frame_size(v: &str) -> Result<u32, Refusal> {
        let n = size(v)?;
        match u32::try_from(n) {
            Ok(n) if (16_384..=16_777_215).contains(&n) => Ok(n),
            _ => Err(Refusal::FrameSize(n)),
        }
    }

    pub fn nonzero_size(v: &str) -> Result<u64, Refusal> {
        Ok(size(v)?.max(1))
    }

    pub fn duration(v: &str) -> Result<std::time::Duration, Refusal> {
        Ok(batchfs::units::parse_duration(v)?)
    }

    /// A wait that must end later than at once (`timeout`, `stall_timeout`).
    pub fn wait(v: &str) -> Result<std::time::Duration, Refusal> {
        match duration(v)? {
            d if d.is_zero() => Err(Refusal::Expected("a duration above zero, e.g. 30s")),
            d => Ok(d),
        }
    }

    /// A switch: given alone (`-o allow_other`, `--allow-other`) it is on.
    pub fn switch(v: &str) -> Result<bool, Refusal> {
        match v {
            "" => Ok(true),
            _ => Ok(batchfs::units::parse_switch(v)?),
        }
    }

    /// A path, made absolute against the working directory where it is relative (the mount's worker, a
    /// systemd restart, may run elsewhere); an empty one (`cache_dir=$UNSET`) is refused: it was the
    /// working directory, and a node cache was filed there.
    pub fn path(v: &str) -> Result<Option<PathBuf>, Refusal> {
        if v.trim().is_empty() {
            return Err(Refusal::Expected("a path"));
        }
        std::path::absolute(v).map(Some).map_err(|_| Refusal::Expected("a path"))
    }

    pub fn servers(v: &str) -> Result<Vec<String>, Refusal> {
        let urls: Vec<String> =
            v.split(';').filter(|s| !s.is_empty()).map(|s| s.trim_end_matches('/').to_owned()).collect();
        let base = |u: &String| {
            (u.starts_with("http://") || u.starts_with("https://"))
                && crate::client::check_url_parts(u).is_ok()
                && u.split_once("://").is_some_and(|(_, rest)| !rest.is_empty() && !rest.contains('/'))
        };
        match urls.iter().all(base) {
            true => Ok(urls),
            false => Err(Refusal::Expected(
                "`;`-separated base URLs without a path, credentials or query, e.g. http://a:8080;http://b:8080",
            )),
        }
    }

    pub fn addr(v: &str) -> Result<Option<std::net::SocketAddr>, Refusal> {
        v.parse().map(Some).map_err(|_| Refusal::Expected("ADDR:PORT, e.g. 127.0.0.1:9187"))
    }

    pub fn rolling(v: &str) -> Result<RollingMode, Refusal> {
        match v {
            "auto" => Ok(RollingMode::Auto),
            // `slots` was the padded layout the indexed one replaced, for the same readers.
            "indexed" | "slots" => Ok(RollingMode::Indexed),
            "packed" => Ok(RollingMode::Packed),
            _ => Err(Refusal::Expected("auto, indexed or packed")),
        }
    }

    /// `R/W`: rank R (from 0) of W.
    pub fn share(v: &str) -> Result<(u32, u32), Refusal> {
        let parsed = v.split_once('/').and_then(|(r, w)| Some((r.parse::<u32>().ok()?, w.parse::<u32>().ok()?)));
        match parsed {
            Some((r, w)) if w >= 1 && r < w => Ok((r, w)),
            _ => Err(Refusal::Expected("R/W, a rank below the number of mounts, e.g. 0/8")),
        }
    }

    pub fn warm(v: &str) -> Result<super::Warm, Refusal> {
        match v {
            "none" => Ok(super::Warm::None),
            "raw" => Ok(super::Warm::Raw),
            _ => Err(Refusal::Expected("none or raw")),
        }
    }

    pub fn page_cache(v: &str) -> Result<PageCache, Refusal> {
        match v {
            "drop" => Ok(PageCache::Drop),
            "keep" => Ok(PageCache::Keep),
            _ => Err(Refusal::Expected("drop or keep")),
        }
    }
}

/// Why an option's value was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("expected {0}")]
    Expected(&'static str),
    #[error("too large")]
    TooLarge,
    #[error("epochs go up to {}", batchfs::plan::MAX_EPOCH)]
    Epoch,
    #[error("a job reads 1 to {} epochs", batchfs::plan::MAX_EPOCH + 1)]
    Span,
    #[error("expected auto or a number from 1 to {} (FUSE threads beyond the CPUs only take turns)", MOST_THREADS)]
    Threads,
    #[error("an HTTP/2 frame is 16K to 16M-1 bytes, not {0}")]
    FrameSize(u64),
    /// A size, a duration or a switch the core's unit parser refused.
    #[error(transparent)]
    Unit(#[from] batchfs::units::UnitError),
}

/// A long flag's value, as given. (An option whose type is itself an `Option`, such as `cache_dir`, was a
/// flag field of `Option<Option<_>>`, which clap reads as a flag whose value may be left out and asks its
/// parser for the inner type: giving the flag panicked in clap.)
#[derive(Debug, Clone)]
pub struct Given<T>(pub T);

macro_rules! options {
    ($(
        $name:ident: $ty:ty = $default:expr, $parse:path, $shown:literal, $placeholder:literal, $heading:literal,
            $help:literal;
    )+) => {
        /// Everything a mount is configured with. Defaults are documented in `docs/CONFIGURATION.md`.
        #[derive(Debug, Clone, PartialEq)]
        pub struct MountOptions {
            /// The plan (`batch_size`, `seed`, `shuffle`, `drop_last`).
            pub plan: PlanOptions,
            /// `tfrecord` or `tar`.
            pub format: BatchFormat,
            $( #[doc = $help] pub $name: $ty, )+
        }

        impl Default for MountOptions {
            fn default() -> Self {
                MountOptions { plan: PlanOptions::default(), format: BatchFormat::Tfrecord, $( $name: $default, )+ }
            }
        }

        /// The options as long flags (each overrides the `-o` lists and the default).
        #[derive(Debug, Default, clap::Args)]
        pub struct OptionFlags {
            $(
                #[arg(long, value_name = $placeholder,
                      value_parser = (|v: &str| $parse(v).map(Given)) as fn(&str) -> Result<Given<$ty>, Refusal>,
                      // A switch's value only as `--x=off`: `--allow-other URL DIR` leaves URL to the URL.
                      num_args = if $placeholder == "BOOL" { 0..=1 } else { 1..=1 },
                      require_equals = $placeholder == "BOOL", default_missing_value = "",
                      help = concat!($help, " [default: ", $shown, "]"), help_heading = $heading)]
                pub $name: Option<Given<$ty>>,
            )+
        }

        impl OptionFlags {
            /// Applies the flags given to `options`.
            pub fn apply(&self, options: &mut MountOptions) {
                $( if let Some(Given(v)) = &self.$name { options.$name = v.clone(); } )+
            }
        }

        impl MountOptions {
            /// Applies option `key` (not a plan option) if it is one: `None` if it is not.
            fn set_declared(&mut self, key: &str, value: &str) -> Option<Result<(), Refusal>> {
                match key {
                    $( stringify!($name) => Some($parse(value).map(|v| self.$name = v)), )+
                    _ => None,
                }
            }
        }

        /// Each option's name, its default as shown in the help and the docs, and whether that text is
        /// the default (parsed to it, or an unset default shown as text).
        #[cfg(test)]
        fn documented_defaults() -> Vec<(&'static str, &'static str, bool)> {
            let defaults = MountOptions::default();
            vec![$(
                (stringify!($name), $shown, match $parse($shown.trim_matches('`')) {
                    Ok(v) if v == defaults.$name => true,
                    _ => Unset::is_unset(&defaults.$name) && ["—", "off", "web roots"].contains(&$shown),
                }),
            )+]
        }
    };
}

options! {
    epochs: u64 = 100, value::epochs, "100", "N", "Plan",
        "Epochs the job reads from first_epoch: listed, prefetched across, and the span of rolling/.";
    first_epoch: u64 = 0, value::epoch, "0", "N", "Plan",
        "The epoch the first open of each rolling/ file serves (a job restarted mid-run sets it).";
    rolling: RollingMode = RollingMode::Auto, value::rolling, "`auto`", "LAYOUT", "Plan",
        "Layout of TFRecord files in rolling/: auto (per reader), indexed or packed.";
    share: (u32, u32) = (0, 1), value::share, "0/1", "R/W", "Plan",
        "This mount's share of each class in shuffled/: rank R of W mounts of a data-parallel job.";
    prefetch: usize = 16, value::batches, "16", "N", "Prefetch",
        "Batches kept cached or in flight ahead of each reader stream (0: no prefetch).";
    prefetch_bytes: u64 = 128 << 20, value::size, "128M", "SIZE", "Prefetch",
        "The window ahead of each reader holds at least this many bytes of batches (more than `prefetch` \
         when they are small; 0: `prefetch` batches only).";
    max_prefetch_bytes: u64 = 256 << 20, value::nonzero_size, "256M", "SIZE", "Prefetch",
        "Bytes of prefetches in flight at once, all readers together.";
    cache: u64 = 2 << 30, value::size, "2G", "SIZE", "Prefetch",
        "Byte budget of the cache, fetches in flight included.";
    cache_dir: Option<PathBuf> = None, value::path, "—", "DIR", "Prefetch",
        "A node cache on local disk: verified objects kept by content, across remounts and mounts.";
    cache_dir_size: u64 = 100 << 30, value::disk_size, "100G", "SIZE", "Prefetch",
        "Bytes the node cache keeps at most (the least recently used go first).";
    cache_dir_checks: usize = crate::node_cache::DEFAULT_CHECKS, value::batches, "131072", "N", "Prefetch",
        "Node cache files whose check the mount remembers, not reading them again while unchanged (0: none).";
    warm: Warm = Warm::None, value::warm, "`none`", "WHAT", "Prefetch",
        "raw: fetch every file of the dataset into the node cache, in batches, once mounted.";
    stale_after: Duration = Duration::from_secs(10), value::duration, "10s", "DURATION", "Prefetch",
        "A cached batch unread for this long may make room for prefetches.";
    connections: usize = 4, value::at_least_one, "4", "N", "Network",
        "HTTP/2 connections per server.";
    timeout: Duration = Duration::from_secs(60), value::wait, "60s", "DURATION", "Network",
        "How long reads wait out an unreachable server before EIO (a busy link still sending waits on).";
    stall_timeout: Duration = Duration::from_secs(10), value::wait, "10s", "DURATION", "Network",
        "A response with no bytes for this long, nor its connection's others, is abandoned and retried.";
    keepalive: Duration = Duration::from_secs(15), value::duration, "15s", "DURATION", "Network",
        "A connection quiet this long is sent a PING, and dropped if nothing answers within stall_timeout \
         (0: never).";
    frame_size: u32 = 1 << 20, value::frame_size, "1M", "SIZE", "Network",
        "The largest HTTP/2 DATA frame the servers may send (16K to 16M-1).";
    servers: Urls = Vec::new(), value::servers, "—", "URLS", "Network",
        "More servers holding the same dataset, `;`-separated base URLs.";
    token_file: Option<PathBuf> = None, value::path, "—", "FILE", "Security",
        "File holding the bearer token.";
    ca_file: Option<PathBuf> = None, value::path, "web roots", "FILE", "Security",
        "PEM CA certificates for https:// servers.";
    allow_other: bool = false, value::switch, "off", "BOOL", "FUSE",
        "Let other users read the mount (sets default_permissions).";
    auto_unmount: bool = false, value::switch, "off", "BOOL", "FUSE",
        "Ask the kernel to unmount when the daemon exits.";
    threads: usize = AUTO_THREADS, value::threads, "`auto`", "N", "FUSE",
        "FUSE worker threads (all but one may wait on the server; more waits go to helper threads); auto: \
         the CPUs the mount may run on, 2 to 16; a number at most 1024.";
    passthrough: bool = true, value::switch, "true", "BOOL", "FUSE",
        "Hand verified files to the kernel (FUSE passthrough) where it allows.";
    huge_pages: bool = true, value::switch, "true", "BOOL", "FUSE",
        "Make passthrough's memory files on a private huge-page tmpfs (root), not 4 KiB memfds.";
    page_cache: PageCache = PageCache::Drop, value::page_cache, "drop", "MODE", "FUSE",
        "drop: a file read through the daemon leaves the kernel page cache at its last close; keep.";
    fuse_uring: bool = false, value::switch, "off", "BOOL", "FUSE",
        "Take FUSE requests over io_uring where the kernel offers it (Linux 6.14+, enable_uring); supervise=false.";
    read_ahead_kb: u32 = 1024, value::kb, "1024", "KB", "FUSE",
        "Kernel readahead of the mount in KiB, set as root (0: the kernel's default).";
    log_file: Option<PathBuf> = None, value::path, "—", "FILE", "Daemon",
        "Where a daemonized mount logs.";
    energy_log: Option<PathBuf> = None, value::path, "—", "FILE", "Daemon",
        "Energy timeline with the bytes served, as JSON lines.";
    metrics: Option<std::net::SocketAddr> = None, value::addr, "off", "ADDR", "Daemon",
        "Serve the counters for Prometheus at GET /metrics on this address.";
    supervise: bool = true, value::switch, "true", "BOOL", "Daemon",
        "Serve from a worker that a small supervisor holding the mount replaces when it dies or is upgraded.";
    worker_starts: u64 = 5, value::count, "5", "N", "Daemon",
        "Workers in a row that do not reach service before the supervisor gives the mount up (0: never).";
    worker_settle: Duration = Duration::from_secs(10), value::duration, "10s", "DURATION", "Daemon",
        "A worker that dies sooner after serving (killed too) did not reach service: counted, waited for (0: none).";
    resend: bool = true, value::switch, "true", "BOOL", "Daemon",
        "On a takeover, have the kernel re-send what the dead worker had read (Linux 6.9; off: those fail).";
}

/// Options mount(8) passes that mean nothing to batchfs.
const IGNORED: &[&str] = &[
    "_netdev", "defaults", "auto", "noauto", "user", "users", "nouser", "owner", "nofail", "ro", "rw", "exec",
    "noexec", "suid", "nosuid", "dev", "nodev", "atime", "noatime", "relatime", "async", "sync",
];

/// Why a mount option was refused.
#[derive(Debug, thiserror::Error)]
pub enum OptionError {
    #[error("unknown mount option {0:?} (see docs/CONFIGURATION.md)")]
    Unknown(String),
    #[error("option {0} needs a value ({0}=...)")]
    NeedsValue(String),
    /// A value its option's parser refused, with the parser's reason.
    #[error("{key}={value}: {reason}")]
    Value { key: String, value: String, reason: Refusal },
    /// A plan option (or the format) refused as the server refuses it in a query.
    #[error(transparent)]
    Plan(#[from] batchfs::api::ApiError),
    /// A format the mount does not show: it names only the mount's (the server's list named three more).
    #[error("format={0}: a mount shows tfrecord (with .idx twins) or tar")]
    Format(String),
}

/// `threads=auto`: as many FUSE threads as CPUs the mount may run on, at least 2 and at most 16 (see
/// [`MountOptions::fuse_threads`]).
pub const AUTO_THREADS: usize = 0;

/// The most FUSE threads `threads` asks for. Each holds a 16 MiB request buffer and a stack, and a thread
/// that cannot be started ends the session; Linux hands each request to the thread that has waited
/// longest, so threads beyond the CPUs only take turns, and requests that wait on the network go to
/// helper threads. 1024 is four times the threads a CPU serves with `fuse_uring` (up to 256), more than
/// any machine's requests in flight; a larger number is a slip (`threads=5000000` was taken, and its
/// worker died under a pids limit).
pub const MOST_THREADS: usize = 1024;

impl MountOptions {
    /// The FUSE threads to run: `threads`, or with `auto` the CPUs this process may run on (its affinity
    /// and its cgroup's quota, `available_parallelism`), at least 2 and at most 16. Linux hands each
    /// request to the `/dev/fuse` reader that has waited longest, so threads beyond the CPUs take turns
    /// and each is woken cold: on 2 vCPUs, 2 threads against 16 made ImageFolder's epoch over a warm
    /// `cache_dir` 0.95x (`raw/`) and 0.84-0.94x (`shuffled/`), the daemon's CPU 0.7-0.9x
    /// (docs/BENCHMARKS.md). Requests that wait on the network beyond `threads - 1` go to helper
    /// threads, so fewer FUSE threads never hold a waiting request back.
    pub fn fuse_threads(&self) -> usize {
        match self.threads {
            AUTO_THREADS => std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 16),
            n => n,
        }
    }

    /// Applies one `key[=value]` option.
    pub fn set(&mut self, key: &str, value: Option<&str>) -> Result<(), OptionError> {
        match key {
            // The plan options: parsed as the server parses them in a query.
            "batch_size" | "seed" | "shuffle" | "block_bytes" | "drop_last" => {
                let mut query = self.query();
                query.set(key, value)?;
                self.plan = query.plan;
                Ok(())
            }
            // The format, of the server's those a mount shows.
            "format" => {
                let format = value.ok_or_else(|| OptionError::NeedsValue(key.to_owned()))?;
                match format.parse() {
                    Ok(f @ (BatchFormat::Tfrecord | BatchFormat::Tar)) => {
                        self.format = f;
                        Ok(())
                    }
                    _ => Err(OptionError::Format(format.to_owned())),
                }
            }
            // mount(8)'s own: ignored (`comment=...` and `x-...` are for other programs to read).
            k if IGNORED.contains(&k) || k.starts_with("x-") || k == "comment" => Ok(()),
            _ => match self.set_declared(key, value.unwrap_or("")) {
                Some(Ok(())) => Ok(()),
                Some(Err(_)) if value.is_none() => Err(OptionError::NeedsValue(key.to_owned())),
                Some(Err(reason)) => {
                    Err(OptionError::Value { key: key.to_owned(), value: value.unwrap_or("").to_owned(), reason })
                }
                None => Err(OptionError::Unknown(key.to_owned())),
            },
        }
    }

    /// Applies a comma-separated `-o` list.
    pub fn apply_list(&mut self, list: &str) -> Result<(), OptionError> {
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (item, None),
            };
            self.set(key, value)?;
        }
        Ok(())
    }

    /// The query the client sends.
    pub fn query(&self) -> BatchQuery {
        BatchQuery { plan: self.plan, format: self.format }
    }
}

/// A value a default may leave unset, shown as `—`, `off` or the like in the docs, not as a value (for the
/// docs test).
#[cfg(test)]
trait Unset {
    fn is_unset(&self) -> bool {
        false
    }
}

#[cfg(test)]
impl<T> Unset for Option<T> {
    fn is_unset(&self) -> bool {
        self.is_none()
    }
}

#[cfg(test)]
impl Unset for Vec<String> {
    fn is_unset(&self) -> bool {
        self.is_empty()
    }
}

#[cfg(test)]
impl Unset for u64 {}
#[cfg(test)]
impl Unset for u32 {}
#[cfg(test)]
impl Unset for usize {}
#[cfg(test)]
impl Unset for bool {}
#[cfg(test)]
impl Unset for Duration {}
#[cfg(test)]
impl Unset for RollingMode {}
#[cfg(test)]
impl Unset for PageCache {}
#[cfg(test)]
impl Unset for (u32, u32) {}
#[cfg(test)]
impl Unset for Warm {}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfs::plan::Shuffle;

    /// An empty path (`cache_dir=$UNSET`) is refused: the node cache was filed in the working directory.
    /// A relative one is made absolute where it is given.
    #[test]
    fn paths_are_absolute_and_never_empty() {
        for empty in ["cache_dir=", "token_file= ", "ca_file="] {
            let mut o = MountOptions::default();
            assert!(o.apply_list(empty).is_err(), "{empty}");
        }
        let mut o = MountOptions::default();
        o.apply_list("cache_dir=nvme/cache").unwrap();
        let want = std::env::current_dir().unwrap().join("nvme/cache");
        assert_eq!(o.cache_dir.as_deref(), Some(want.as_path()));
        o.apply_list("cache_dir=/nvme/batchfs").unwrap();
        assert_eq!(o.cache_dir.as_deref(), Some(std::path::Path::new("/nvme/batchfs")));
    }

    #[test]
    fn the_deployment_mount_options_parse() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
        let read = |f: &str| std::fs::read_to_string(format!("{root}/{f}")).unwrap();
        let unit = read("systemd/mnt-imagenet.mount");
        let fstab = read("systemd/fstab.example");
        let daemonset = read("k8s/mount-daemonset.yaml");
        let lists = [
            unit.lines().find_map(|l| l.strip_prefix("Options=")).unwrap().to_owned(),
            fstab.lines().find(|l| !l.starts_with('#')).unwrap().split_whitespace().nth(3).unwrap().to_owned(),
            daemonset.split("\"-o\", \"").nth(1).unwrap().split('"').next().unwrap().to_owned(),
        ];
        for list in lists {
            let mut o = MountOptions::default();
            o.apply_list(&list).unwrap_or_else(|e| panic!("{list}: {e}"));
            assert_eq!((o.plan.batch_size, o.epochs), (256, 90), "{list}");
        }
    }

    #[test]
    fn fstab_style_lists() {
        let mut o = MountOptions::default();
        let list = "_netdev,batch_size=64,prefetch=8,cache=512M,shuffle=none,drop_last,format=tar,timeout=5s,\
                    servers=http://a:1;http://b:2/,allow_other,x-systemd.automount,comment=gpu-nodes";
        o.apply_list(list).unwrap();
        assert_eq!(o.plan.batch_size, 64);
        assert_eq!(o.prefetch, 8);
        assert_eq!(o.cache, 512 << 20);
        assert_eq!(o.prefetch_bytes, 128 << 20, "the default");
        o.apply_list("prefetch_bytes=0").unwrap();
        assert_eq!(o.prefetch_bytes, 0);
        assert_eq!(o.plan.shuffle, Shuffle::None);
        assert!(o.plan.drop_last && o.allow_other);
        assert_eq!(o.format, BatchFormat::Tar);
        assert_eq!(o.timeout, Duration::from_secs(5));
        assert_eq!(o.servers, ["http://a:1", "http://b:2"]);
        assert_eq!(o.page_cache, PageCache::Drop, "dropped by default");
        o.apply_list("page_cache=keep").unwrap();
        assert_eq!(o.page_cache, PageCache::Keep);
        assert_eq!((o.first_epoch, o.rolling, o.epochs), (0, RollingMode::Auto, 100));
        o.apply_list("first_epoch=7,rolling=packed").unwrap();
        assert_eq!((o.first_epoch, o.rolling), (7, RollingMode::Packed));
        o.apply_list("rolling=slots").unwrap();
        assert_eq!(o.rolling, RollingMode::Indexed, "the former name");
        let bad = [
            "batch_size=0",
            "cache=lots",
            "format=zip",
            "format=tfrecord.slots",
            "colour=red",
            "seed",
            "drop_last=maybe",
            "page_cache=x",
            "rolling=sideways",
            "first_epoch=1000000",
            "epochs=0",
            "epochs=1000001",
            "timeout=0",
            "stall_timeout=0s",
            "servers=foo",
            "connections=0",
            "threads=0",
            "cache_dir_size=0",
            "servers=http://a:1;http://u:p@b:2",
            "servers=http://a:1/ds",
            "servers=http://a:1?x=1",
        ];
        for bad in bad {
            assert!(MountOptions::default().apply_list(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn fuse_threads_are_the_cpus_by_default_and_as_given_otherwise() {
        let cpus = std::thread::available_parallelism().unwrap().get();
        let auto = MountOptions::default();
        assert_eq!(auto.threads, AUTO_THREADS);
        assert_eq!(auto.fuse_threads(), cpus.clamp(2, 16));
        let mut given = MountOptions::default();
        given.apply_list("threads=5").unwrap();
        assert_eq!(given.fuse_threads(), 5);
        assert!(given.apply_list("threads=0").is_err(), "refused, not taken as 1 without a word");
        given.apply_list(&format!("threads={MOST_THREADS}")).unwrap();
        assert_eq!(given.fuse_threads(), MOST_THREADS);
        for too_many in [MOST_THREADS + 1, 5_000_000] {
            let e = MountOptions::default().apply_list(&format!("threads={too_many}")).unwrap_err().to_string();
            assert!(e.contains(&format!("from 1 to {MOST_THREADS}")), "{e}");
        }
        given.apply_list("threads=auto").unwrap();
        assert_eq!(given.fuse_threads(), auto.fuse_threads());
    }

    #[test]
    fn each_option_has_one_default_shown_in_help_and_docs() {
        let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CONFIGURATION.md")).unwrap();
        let section = &docs[docs.find("## batchfs mount").unwrap()..];
        for (name, shown, is_default) in documented_defaults() {
            assert!(is_default, "{name}: the default shown, {shown:?}, is not the default value");
            let row = format!("| `{name}` | {shown} |");
            assert!(section.contains(&row), "docs/CONFIGURATION.md lacks the row {row:?}");
        }
    }

    #[test]
    fn flags_and_lists_set_options_alike() {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Flags {
            #[command(flatten)]
            options: OptionFlags,
        }
        let parse = |args: &[&str]| Flags::try_parse_from(std::iter::once("x").chain(args.iter().copied()));
        let mut by_flags = MountOptions::default();
        parse(&["--cache", "1G", "--allow-other", "--passthrough=false", "--servers", "http://a:1;http://b:2"])
            .unwrap()
            .options
            .apply(&mut by_flags);
        let mut by_list = MountOptions::default();
        by_list.apply_list("cache=1G,allow_other,passthrough=false,servers=http://a:1;http://b:2").unwrap();
        assert_eq!(by_flags, by_list);
        assert_eq!((by_list.cache, by_list.allow_other, by_list.passthrough), (1 << 30, true, false));
        assert!(parse(&["--cache", "lots"]).is_err() && parse(&["--cache"]).is_err());
        // Options whose value is itself optional, as flags: before, giving one panicked in clap.
        let mut by_flags = MountOptions::default();
        let paths = ["--cache-dir", "/c", "--token-file", "/t", "--ca-file", "/a", "--log-file", "/l"];
        parse(&[&paths[..], &["--energy-log", "/e", "--metrics", "127.0.0.1:9"]].concat())
            .unwrap()
            .options
            .apply(&mut by_flags);
        let mut by_list = MountOptions::default();
        by_list
            .apply_list("cache_dir=/c,token_file=/t,ca_file=/a,log_file=/l,energy_log=/e,metrics=127.0.0.1:9")
            .unwrap();
        assert_eq!(by_flags, by_list);
        assert_eq!(
            (by_list.cache_dir.as_deref(), by_list.metrics),
            (Some(std::path::Path::new("/c")), "127.0.0.1:9".parse().ok())
        );
        let e = MountOptions::default().apply_list("cache").unwrap_err();
        assert!(matches!(&e, OptionError::NeedsValue(k) if k == "cache"), "{e}");
        assert!(e.to_string().contains("needs a value"), "{e}");
        let e = MountOptions::default().apply_list("threads=many").unwrap_err();
        assert!(matches!(&e, OptionError::Value { key, .. } if key == "threads"), "{e}");
        assert!(e.to_string().contains("threads=many") && e.to_string().contains("auto or a number"), "{e}");
        let e = MountOptions::default().apply_list("batch_size=0").unwrap_err();
        assert!(matches!(e, OptionError::Plan(_)), "a plan option refused as the server refuses it: {e}");
        for format in ["lmdb", "tfrecord.idx", "tfrecord.slots"] {
            let e = MountOptions::default().apply_list(&format!("format={format}")).unwrap_err().to_string();
            assert_eq!(e, format!("format={format}: a mount shows tfrecord (with .idx twins) or tar"));
        }
        let e = MountOptions::default().apply_list("bogus=1").unwrap_err();
        assert!(matches!(&e, OptionError::Unknown(k) if k == "bogus"), "{e}");
    }
}
