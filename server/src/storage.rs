//! How the server reads a dataset's shards: mapped, or by positioned reads.
//!
//! A dataset of a few large shards (TFRecord, tar, LMDB) is mapped once, shard by shard, and its bodies
//! share the mappings (no copy). A dataset of more shards than `max_mapped_shards` (a file tree of
//! ImageNet's 1.28 M images) is not mapped at all: each mapping is a kernel VMA, and the kernel allows
//! `vm.max_map_count` of them per process (65,530 by default), so one mapping per file cannot start.
//! Such shards are opened when read, read with `pread`, and closed: no mapping and no file descriptor
//! is held per file, whatever the file count.
//!
//! Either way a read of storage never runs on a tokio worker: the body streams (`body.rs`) and warming
//! (`service.rs`) do it on the blocking pool, within the storage semaphore.

use crate::catalog::CatalogError;
use batchfs::index::Index;
use batchfs::mmap::MappedFile;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One shard, as the server reads it.
pub enum Shard {
    Mapped(Arc<MappedFile>),
    /// Read with positioned reads from the file at `path`, which holds `size` bytes.
    File {
        path: PathBuf,
        size: u64,
    },
}

/// Every shard of one dataset, by shard number.
pub struct Storage {
    shards: Box<[Shard]>,
}

impl Storage {
    /// Opens the shards of `index` under `root`: mapped when there are at most `max_mapped` of them,
    /// else read by positioned reads. Checks that each shard still has its indexed size.
    pub fn open(name: &str, root: &Path, index: &Index, max_mapped: usize) -> Result<Storage, CatalogError> {
        let map = index.shards.len() <= max_mapped;
        let mut shards = Vec::with_capacity(index.shards.len());
        for shard in &index.shards {
            let path = root.join(&shard.path);
            let changed = || CatalogError::Changed { name: name.to_owned(), path: path.clone() };
            let cannot = |source| CatalogError::Map { name: name.to_owned(), path: path.clone(), source };
            if !map {
                // A stat per file: the index's size must still hold (reads past it would fail later).
                let size = std::fs::metadata(&path).map_err(cannot)?.len();
                if size != shard.size {
                    return Err(changed());
                }
                shards.push(Shard::File { path, size });
                continue;
            }
            let mapped = MappedFile::open(&path).map_err(cannot)?;
            if mapped.len() != shard.size {
                return Err(changed());
            }
            // Batches of a shuffled plan read samples in random order: kernel readahead would read the
            // wrong pages, so the server warms exactly the ranges it will send instead.
            mapped.advise(memmap2::Advice::Random);
            shards.push(Shard::Mapped(Arc::new(mapped)));
        }
        Ok(Storage { shards: shards.into_boxed_slice() })
    }

    /// Shard `n`.
    pub fn shard(&self, n: u32) -> &Shard {
        &self.shards[n as usize]
    }

    /// How many shards are mapped (all or none).
    pub fn mapped(&self) -> usize {
        self.shards.iter().filter(|s| matches!(s, Shard::Mapped(_))).count()
    }

    /// Asks the kernel to bring `[offset, offset + len)` of shard `n` into memory and waits until it is
    /// there. Blocks: call on the blocking pool.
    pub fn warm(&self, n: u32, offset: u64, len: u64) -> std::io::Result<()> {
        match self.shard(n) {
            Shard::Mapped(map) => {
                if !map.is_resident(offset, len) {
                    crate::body::fault_in(map, offset, len);
                }
                Ok(())
            }
            // Reading the range loads the page cache; the next read of it is a copy from memory.
            Shard::File { .. } => self.read(n, offset, len, &mut Vec::new()),
        }
    }

    /// Hints that `[offset, offset + len)` of shard `n` will be read soon (mapped shards only: the hint
    /// does not block).
    pub fn will_need(&self, n: u32, offset: u64, len: u64) {
        if let Shard::Mapped(map) = self.shard(n) {
            map.will_need(offset, len);
        }
    }

    /// Appends `[offset, offset + len)` of shard `n` to `out`. Blocks: call on the blocking pool.
    pub fn read(&self, n: u32, offset: u64, len: u64, out: &mut Vec<u8>) -> std::io::Result<()> {
        let start = out.len();
        match self.shard(n) {
            Shard::Mapped(map) => out.extend_from_slice(&map.bytes()[offset as usize..(offset + len) as usize]),
            Shard::File { path, size } => {
                if offset + len > *size {
                    return Err(std::io::Error::other(format!("{}: range past the indexed size", path.display())));
                }
                out.resize(start + len as usize, 0);
                let file = std::fs::File::open(path)?;
                file.read_exact_at(&mut out[start..], offset).map_err(|e| {
                    // A file shorter than indexed changed under the server: the body must not go on.
                    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
                })?;
            }
        }
        Ok(())
    }
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
        let mapped = Storage::open("t", dir.path(), &index, usize::MAX).unwrap();
        let files = Storage::open("t", dir.path(), &index, 1).unwrap();
        assert_eq!((mapped.mapped(), files.mapped()), (index.shards.len(), 0));
        for (n, shard) in index.shards.iter().enumerate() {
            let (mut a, mut b) = (Vec::new(), vec![7u8]);
            mapped.read(n as u32, 1, shard.size - 1, &mut a).unwrap();
            files.read(n as u32, 1, shard.size - 1, &mut b).unwrap();
            assert_eq!(&b[1..], &a[..], "shard {n}");
            files.warm(n as u32, 0, shard.size).unwrap();
        }
        let past = files.read(0, index.shards[0].size, 1, &mut Vec::new()).unwrap_err();
        assert!(past.to_string().contains("past the indexed size"), "{past}");
        // A file that changed size since indexing is refused at open, mapped or not.
        let first = dir.path().join(&index.shards[0].path);
        std::fs::write(&first, b"shorter").unwrap();
        assert!(matches!(Storage::open("t", dir.path(), &index, 1), Err(CatalogError::Changed { .. })));
        assert!(matches!(Storage::open("t", dir.path(), &index, usize::MAX), Err(CatalogError::Changed { .. })));
    }
}
