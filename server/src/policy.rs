//! How the server reads datasets, as the `io`, `resident` and `max_mapped_shards` limits say, and the
//! memory it may use: the policy types `config` parses and `storage` follows (a leaf: it uses neither).
//! A value that does not parse is a [`PolicyError`].

use std::path::PathBuf;

/// Whether a dataset path names an object store (`s3://...`) rather than a directory.
pub fn is_object_url(path: &std::path::Path) -> bool {
    path.to_str().is_some_and(|s| s.starts_with("s3://") || s.starts_with("s3a://"))
}

/// Why an `io`, `disk_cache`, `resident` or `disk_cache_size` value does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("{text:?} is not an I/O mode (auto, mmap, pread or direct)")]
    NotAnIoMode { text: String },
    #[error("expected a directory, or none")]
    NoDirectory,
    /// Neither `auto` nor a size (the size parser's error its cause).
    #[error("{text:?} is neither auto nor a size")]
    NotAutoOrSize { text: String, source: batchfs::units::UnitError },
}

/// How datasets are read (the `io` limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// Mapped when the dataset fits in half the server's memory, else direct reads (or positioned
    /// reads where the filesystem refuses `O_DIRECT`).
    Auto,
    Mmap,
    Pread,
    Direct,
}

impl IoMode {
    /// `auto`, `mmap`, `pread` or `direct`.
    pub fn parse(text: &str) -> Result<IoMode, PolicyError> {
        match text.trim() {
            "auto" => Ok(IoMode::Auto),
            "mmap" => Ok(IoMode::Mmap),
            "pread" => Ok(IoMode::Pread),
            "direct" => Ok(IoMode::Direct),
            other => Err(PolicyError::NotAnIoMode { text: other.to_owned() }),
        }
    }
}

/// The directory of the disk tier (`disk_cache`), if any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierDir(pub Option<PathBuf>);

impl TierDir {
    /// A directory, or `none`.
    pub fn parse(text: &str) -> Result<TierDir, PolicyError> {
        match text.trim() {
            "" => Err(PolicyError::NoDirectory),
            "none" => Ok(TierDir(None)),
            dir => Ok(TierDir(Some(PathBuf::from(dir)))),
        }
    }
}

/// A size the server may work out itself: how many bytes of direct datasets' shards it holds in its own
/// memory (the `resident` limit: auto is half of what the server may use beyond its own
/// [`SERVER_RESERVE`]), or how large its disk tier is (`disk_cache_size`: auto is 90 % of what the tier's
/// filesystem has free).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AutoSize {
    Auto,
    Bytes(u64),
}

/// The `resident` limit.
pub type Resident = AutoSize;

impl AutoSize {
    /// `auto`, or a size (`512M`, `0`).
    pub fn parse(text: &str) -> Result<AutoSize, PolicyError> {
        match text.trim() {
            "auto" => Ok(AutoSize::Auto),
            size => batchfs::units::parse_size(size)
                .map(AutoSize::Bytes)
                .map_err(|source| PolicyError::NotAutoOrSize { text: size.to_owned(), source }),
        }
    }
}

/// What decides how a dataset is read.
#[derive(Debug, Clone, Copy)]
pub struct IoPolicy {
    pub mode: IoMode,
    pub max_mapped_shards: usize,
    /// Memory the server may use, for `auto` (detected: the machine's, or its memory cgroup's limit).
    pub memory: u64,
    /// Bytes of whole shards of direct datasets still to be held in memory (`resident`; what a dataset
    /// takes is subtracted before the next is opened).
    pub resident: u64,
    /// `resident` is `auto` (not a size the user gave): object datasets with a disk tier then hold
    /// nothing, their copies being read as local shards are.
    pub resident_auto: bool,
    /// Mapped shards keep their file open, for `sendfile` (the limit): see `sendfile.rs`.
    pub sendfile: bool,
}

impl IoPolicy {
    /// The policy of reading in `mode`, mapping at most `max_mapped_shards` files per dataset and holding
    /// `resident` in memory, with the memory the server may use detected.
    pub fn new(mode: IoMode, max_mapped_shards: usize, resident: Resident) -> Self {
        let memory = memory_limit();
        let resident_auto = matches!(resident, Resident::Auto);
        let resident = match resident {
            // Unknown memory (no /proc/meminfo): hold nothing.
            Resident::Auto if memory == u64::MAX => 0,
            Resident::Auto => auto_resident(memory),
            Resident::Bytes(n) => n,
        };
        IoPolicy { mode, max_mapped_shards, memory, resident, resident_auto, sendfile: false }
    }

    /// Whether a dataset of `bytes` is mapped: with `io=mmap`, or with `io=auto` where it fits in half the
    /// memory the server may use (else it is read directly, or by positioned reads with `io=pread`).
    pub fn maps(&self, bytes: u64) -> bool {
        match self.mode {
            IoMode::Mmap => true,
            IoMode::Auto => bytes <= self.memory / 2,
            IoMode::Direct | IoMode::Pread => false,
        }
    }
}

/// Caps glibc's malloc arenas at one per CPU this process may run on (2 to 8), unless the environment
/// sets them (`MALLOC_ARENA_MAX`, or `arena_max` in `GLIBC_TUNABLES`): the cap set, if any. glibc's
/// default, 8 per CPU, gives each of the server's threads (the runtime's workers, the blocking pool's,
/// the stager's) an arena of its own, and each arena keeps what was freed in it: a half tier's server
/// in a memory cgroup of 257 MB held 189 MB of anonymous memory after 12 epochs, of which about 95 MB
/// was live; with 2 arenas 111 MB, its CPU and epochs unchanged (docs/BENCHMARKS.md). Call before the
/// threads start: an arena, once made, stays.
pub fn limit_malloc_arenas() -> Option<usize> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let by_env = std::env::var_os("MALLOC_ARENA_MAX").is_some()
            || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("arena_max"));
        if by_env {
            return None;
        }
        let cap = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8);
        // SAFETY: mallopt sets one of malloc's parameters; M_ARENA_MAX bounds the arenas made after it.
        (unsafe { libc::mallopt(libc::M_ARENA_MAX, cap as libc::c_int) } == 1).then_some(cap)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}

/// What a server uses besides the shards it holds (`resident`): its runtime, buffer pools, the bodies in
/// flight, the indexes; about 90 MB measured under one mount of an object dataset with `resident=0`.
pub const SERVER_RESERVE: u64 = 128 << 20;

/// `resident=auto` for a server that may use `memory`: half of what [`SERVER_RESERVE`] leaves. Half of all
/// of it filled a small memory cgroup: a server limited to 128 MB or 192 MB held 48 or 95 MB of shards and
/// was killed by the OOM killer at its first epoch.
pub fn auto_resident(memory: u64) -> u64 {
    memory.saturating_sub(SERVER_RESERVE) / 2
}

/// The memory this process may use: the machine's, or less where a memory cgroup (v1 or v2) on its path
/// limits it.
pub fn memory_limit() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find_map(|l| l.strip_prefix("MemTotal:").map(str::to_owned)))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(u64::MAX, |kb| kb * 1024);
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut limit = total;
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next(), fields.next().unwrap_or(""), fields.next().unwrap_or(""));
        let (base, file) = match controllers {
            "" => ("/sys/fs/cgroup", "memory.max"),
            c if c.split(',').any(|c| c == "memory") => ("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
            _ => continue,
        };
        // Every ancestor's limit applies too.
        let mut dir = PathBuf::from(format!("{base}{path}"));
        loop {
            if let Some(v) = std::fs::read_to_string(dir.join(file)).ok().and_then(|v| v.trim().parse::<u64>().ok()) {
                limit = limit.min(v);
            }
            if dir.as_os_str().len() <= base.len() || !dir.pop() {
                break;
            }
        }
    }
    limit
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small memory cgroup holds no shards by default (the server's own needs come first); a large one
    /// holds half of what those leave.
    #[test]
    fn resident_auto_leaves_the_server_its_own_memory_first() {
        assert_eq!(auto_resident(128 << 20), 0);
        assert_eq!(auto_resident(100 << 20), 0);
        assert_eq!(auto_resident(192 << 20), 32 << 20);
        assert_eq!(auto_resident(24 << 30), ((24 << 30) - (128 << 20)) / 2);
    }
}
