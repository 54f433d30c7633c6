//! How the server reads a dataset's shards: mapped, or by positioned reads.
//!
//! **Mapped** (`io=mmap`): each shard is mapped once and bodies share the mappings (no copy). Right for
//! data that fits in the server's memory: the page cache holds it after the first epoch.
//!
//! **Positioned reads** (`io=pread`): each body chunk is read with `pread` on the blocking pool. Right
//! for data larger than the server's memory (LMDBIO's case): a sample is one read of its exact bytes,
//! where a mapping faults it in page by page and the kernel's readahead reads what a shuffled epoch
//! will not use; and after a range is sent its pages are dropped from the page cache
//! (`POSIX_FADV_DONTNEED`), so an epoch's reads do not evict each other's ranges (or everything else
//! on the machine) before they are used. The next batches' ranges are announced to the kernel ahead
//! (`POSIX_FADV_WILLNEED`, see `warm_ahead` in `service.rs`), so the device reads them in parallel.
//! `io=auto` (the default) maps a dataset when it fits in half of the memory the server may use (the
//! smaller of the machine's memory and its memory cgroup's limit), else reads it by positioned reads.
//!
//! **Many files.** A dataset of more shards than `max_mapped_shards` (a file tree of ImageNet's 1.28 M
//! images) is never mapped: each mapping is a kernel VMA, and the kernel allows `vm.max_map_count` of
//! them per process (65,530 by default), so one mapping per file cannot start. Its files are opened when
//! read, read with `pread`, and closed: no mapping and no file descriptor is held per file.
//!
//! Either way a read of storage never runs on a tokio worker: the body streams (`body.rs`) and warming
//! (`service.rs`) do it on the blocking pool, within the storage semaphore.

use crate::catalog::CatalogError;
use crate::config::ServerLimits;
use batchfs::index::Index;
use batchfs::mmap::MappedFile;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How datasets are read (the `io` limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// Mapped when the dataset fits in half the server's memory, else positioned reads.
    Auto,
    Mmap,
    Pread,
}

impl IoMode {
    /// `auto`, `mmap` or `pread`.
    pub fn parse(text: &str) -> Result<IoMode, String> {
        match text.trim() {
            "auto" => Ok(IoMode::Auto),
            "mmap" => Ok(IoMode::Mmap),
            "pread" => Ok(IoMode::Pread),
            other => Err(format!("{other:?} is not an I/O mode (auto, mmap or pread)")),
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
}

impl IoPolicy {
    /// The policy of `limits`, with the memory detected.
    pub fn of(limits: &ServerLimits) -> Self {
        IoPolicy { mode: limits.io, max_mapped_shards: limits.max_mapped_shards, memory: memory_limit() }
    }
}

impl Default for IoPolicy {
    fn default() -> Self {
        IoPolicy::of(&ServerLimits::default())
    }
}

/// One shard, as the server reads it.
pub enum Shard {
    Mapped(Arc<MappedFile>),
    /// Read with positioned reads from a file held open.
    Open {
        file: File,
        path: PathBuf,
        size: u64,
    },
    /// Read with positioned reads from the file at `path`, opened for each read.
    Closed {
        path: PathBuf,
        size: u64,
    },
}

/// Every shard of one dataset, by shard number.
pub struct Storage {
    shards: Box<[Shard]>,
    /// Drop the pages of each range read from the page cache (the dataset does not fit in memory).
    drop_after_read: bool,
}

impl Storage {
    /// Opens the shards of `index` under `root` as `policy` says (see the module note), checking that
    /// each still has its indexed size.
    pub fn open(name: &str, root: &Path, index: &Index, policy: IoPolicy) -> Result<Storage, CatalogError> {
        let bytes: u64 = index.shards.iter().map(|s| s.size).sum();
        let fits = bytes <= policy.memory / 2;
        let many = index.shards.len() > policy.max_mapped_shards;
        let pread = many || policy.mode == IoMode::Pread || (policy.mode == IoMode::Auto && !fits);
        if many && policy.mode == IoMode::Mmap {
            tracing::warn!(
                dataset = name,
                shards = index.shards.len(),
                max_mapped_shards = policy.max_mapped_shards,
                "too many shards to map: reading them with positioned reads"
            );
        }
        let mut shards = Vec::with_capacity(index.shards.len());
        for shard in &index.shards {
            let path = root.join(&shard.path);
            let changed = || CatalogError::Changed { name: name.to_owned(), path: path.clone() };
            let cannot = |source| CatalogError::Map { name: name.to_owned(), path: path.clone(), source };
            if many {
                // A stat per file: the index's size must still hold (reads past it would fail later).
                let size = std::fs::metadata(&path).map_err(cannot)?.len();
                if size != shard.size {
                    return Err(changed());
                }
                shards.push(Shard::Closed { path, size });
            } else if pread {
                let file = File::open(&path).map_err(cannot)?;
                let size = file.metadata().map_err(cannot)?.len();
                if size != shard.size {
                    return Err(changed());
                }
                shards.push(Shard::Open { file, path, size });
            } else {
                let mapped = MappedFile::open(&path).map_err(cannot)?;
                if mapped.len() != shard.size {
                    return Err(changed());
                }
                // Batches of a shuffled plan read samples in random order: kernel readahead would read
                // the wrong pages, so the server warms exactly the ranges it will send instead.
                mapped.advise(memmap2::Advice::Random);
                shards.push(Shard::Mapped(Arc::new(mapped)));
            }
        }
        // Side files are read whole and seldom (under `raw/`): opened per read.
        for file in &index.side {
            shards.push(Shard::Closed { path: root.join(&file.path), size: file.size });
        }
        let drop_after_read = pread && !fits;
        tracing::info!(
            dataset = name,
            io = if pread { "pread" } else { "mmap" },
            bytes,
            memory = policy.memory,
            drop_after_read,
            "storage opened"
        );
        Ok(Storage { shards: shards.into_boxed_slice(), drop_after_read })
    }

    /// Shard `n`.
    pub fn shard(&self, n: u32) -> &Shard {
        &self.shards[n as usize]
    }

    /// How many shards are mapped (all or none).
    pub fn mapped(&self) -> usize {
        self.shards.iter().filter(|s| matches!(s, Shard::Mapped(_))).count()
    }

    /// Whether the pages of each range read are dropped from the page cache afterwards.
    pub fn drops_after_read(&self) -> bool {
        self.drop_after_read
    }

    /// Brings `[offset, offset + len)` of shard `n` toward memory ahead of its request. Mapped: faults it
    /// in and waits; read by `pread`: asks the kernel to start reading it and returns. Blocks: call on
    /// the blocking pool.
    pub fn warm(&self, n: u32, offset: u64, len: u64) -> std::io::Result<()> {
        match self.shard(n) {
            Shard::Mapped(map) => {
                if !map.is_resident(offset, len) {
                    crate::body::fault_in(map, offset, len);
                }
                Ok(())
            }
            Shard::Open { file, .. } => advise(file, offset, len, libc::POSIX_FADV_WILLNEED),
            Shard::Closed { path, .. } => advise(&File::open(path)?, offset, len, libc::POSIX_FADV_WILLNEED),
        }
    }

    /// Hints that `[offset, offset + len)` of shard `n` will be read soon (does not block).
    pub fn will_need(&self, n: u32, offset: u64, len: u64) {
        match self.shard(n) {
            Shard::Mapped(map) => map.will_need(offset, len),
            Shard::Open { file, .. } => {
                let _ = advise(file, offset, len, libc::POSIX_FADV_WILLNEED);
            }
            // Opening a file to hint it costs what reading a small file does: `warm` does it.
            Shard::Closed { .. } => {}
        }
    }

    /// Appends `[offset, offset + len)` of shard `n` to `out`. Blocks: call on the blocking pool.
    pub fn read(&self, n: u32, offset: u64, len: u64, out: &mut Vec<u8>) -> std::io::Result<()> {
        let start = out.len();
        let opened;
        let (file, path, size) = match self.shard(n) {
            Shard::Mapped(map) => {
                out.extend_from_slice(&map.bytes()[offset as usize..(offset + len) as usize]);
                return Ok(());
            }
            Shard::Open { file, path, size } => (file, path, *size),
            Shard::Closed { path, size } => {
                opened = File::open(path)?;
                (&opened, path, *size)
            }
        };
        if offset + len > size {
            return Err(std::io::Error::other(format!("{}: range past the indexed size", path.display())));
        }
        out.resize(start + len as usize, 0);
        // A file shorter than indexed changed under the server: the body must not go on.
        file.read_exact_at(&mut out[start..], offset)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        if self.drop_after_read {
            let _ = advise(file, offset, len, libc::POSIX_FADV_DONTNEED);
        }
        Ok(())
    }
}

/// `posix_fadvise(2)` on a range of `file`.
fn advise(file: &File, offset: u64, len: u64, advice: libc::c_int) -> std::io::Result<()> {
    // SAFETY: posix_fadvise reads no memory of ours; the descriptor is open for the call's duration
    // (borrowed from `file`).
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), offset as libc::off_t, len as libc::off_t, advice) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(rc))
    }
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
    use batchfs::gen::{self, GenOptions};
    use batchfs::index::SourceFormat;
    use batchfs::source::{self, IndexOptions, NoProgress};

    #[test]
    fn mapped_and_file_shards_read_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let options = GenOptions { format: SourceFormat::Files, samples: 12, mean_bytes: 3000, ..Default::default() };
        gen::generate(&options, dir.path()).unwrap();
        let (index, _) = source::load_or_build(dir.path(), "t", None, &IndexOptions::default(), &NoProgress).unwrap();
        let policy = |mode, max_mapped_shards, memory| IoPolicy { mode, max_mapped_shards, memory };
        let open = |p: IoPolicy| Storage::open("t", dir.path(), &index, p);
        let mapped = open(policy(IoMode::Mmap, usize::MAX, u64::MAX)).unwrap();
        let held = open(policy(IoMode::Pread, usize::MAX, u64::MAX)).unwrap();
        let files = open(policy(IoMode::Auto, 1, u64::MAX)).unwrap();
        // Too large for a server of 1 KiB: read by pread, and dropped from the page cache after reading.
        let big = open(policy(IoMode::Auto, usize::MAX, 1024)).unwrap();
        let fits = open(policy(IoMode::Auto, usize::MAX, u64::MAX)).unwrap();
        assert_eq!(mapped.mapped(), index.shards.len());
        assert_eq!(fits.mapped(), index.shards.len());
        assert_eq!((held.mapped(), files.mapped(), big.mapped()), (0, 0, 0));
        assert!(big.drops_after_read() && !held.drops_after_read() && !files.drops_after_read());
        assert!(matches!(files.shard(0), Shard::Closed { .. }) && matches!(held.shard(0), Shard::Open { .. }));
        for (n, shard) in index.shards.iter().enumerate() {
            let mut want = Vec::new();
            mapped.read(n as u32, 1, shard.size - 1, &mut want).unwrap();
            for other in [&held, &files, &big] {
                let mut got = vec![7u8];
                other.read(n as u32, 1, shard.size - 1, &mut got).unwrap();
                assert_eq!(&got[1..], &want[..], "shard {n}");
                other.warm(n as u32, 0, shard.size).unwrap();
                other.will_need(n as u32, 0, shard.size);
            }
        }
        for other in [&held, &files] {
            let past = other.read(0, index.shards[0].size, 1, &mut Vec::new()).unwrap_err();
            assert!(past.to_string().contains("past the indexed size"), "{past}");
        }
        // A file that changed size since indexing is refused at open, whatever the mode.
        let first = dir.path().join(&index.shards[0].path);
        std::fs::write(&first, b"shorter").unwrap();
        for p in [policy(IoMode::Auto, 1, u64::MAX), policy(IoMode::Mmap, 99, 0), policy(IoMode::Pread, 99, 0)] {
            assert!(matches!(open(p), Err(CatalogError::Changed { .. })));
        }
    }

    #[test]
    fn io_modes_parse_and_memory_is_detected() {
        assert_eq!(IoMode::parse("pread"), Ok(IoMode::Pread));
        assert_eq!(IoMode::parse(" mmap"), Ok(IoMode::Mmap));
        assert!(IoMode::parse("direct").unwrap_err().contains("auto, mmap or pread"));
        let memory = memory_limit();
        assert!(memory > 64 << 20 && memory < u64::MAX, "{memory}");
    }
}
