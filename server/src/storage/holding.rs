//! Shards of a direct dataset held in the server's memory (`resident`, see `storage.rs`): which ones (the
//! first that fit whole in the budget, in index order), read once at start past the page cache, with the
//! progress of that reading logged.

use batchfs::index::Index;
use batchfs::mmap::MappedFile;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Which shards of a direct dataset are held in memory (the first that fit whole in the budget, in index
/// order), and the progress of reading them: a log line when it starts, one every few seconds with an
/// ETA (a budget of many GB takes a while to read), and the time taken in `storage opened`.
pub(super) struct Holding<'a> {
    name: &'a str,
    budget: u64,
    /// Bytes the dataset's shards will take: the sizes [`Holding::takes`] accepts, in index order.
    total: u64,
    pub(super) done: u64,
    pub(super) started: std::time::Instant,
    reported: std::time::Instant,
}

impl<'a> Holding<'a> {
    pub(super) fn new(name: &'a str, index: &Index, budget: u64) -> Self {
        let total = index.shards.iter().fold(0, |held, s| if held + s.size <= budget { held + s.size } else { held });
        let now = std::time::Instant::now();
        Holding { name, budget, total, done: 0, started: now, reported: now }
    }

    /// Whether the next shard, of `size` bytes, is held.
    pub(super) fn takes(&self, size: u64) -> bool {
        self.done + size <= self.budget
    }

    pub(super) fn add(&mut self, size: u64) {
        if self.done == 0 {
            tracing::info!(dataset = self.name, bytes = self.total, "holding shards in memory");
        }
        self.done += size;
        if self.reported.elapsed() >= std::time::Duration::from_secs(5) && self.done < self.total {
            self.reported = std::time::Instant::now();
            let rate = self.done as f64 / self.started.elapsed().as_secs_f64();
            let eta = (self.total - self.done) as f64 / rate.max(1.0);
            let percent = self.done as f64 * 100.0 / self.total as f64;
            tracing::info!(
                dataset = self.name,
                done = self.done,
                total = self.total,
                eta_s = format!("{eta:.0}"),
                "holding shards in memory: {percent:.0}%"
            );
        }
    }
}

/// The `size` bytes of `file` (opened `O_DIRECT`) read into memory the server owns, past the page cache.
pub(super) fn hold(file: &File, path: &Path, size: u64) -> std::io::Result<MappedFile> {
    MappedFile::in_memory(size as usize, |memory| {
        // Whole blocks, in steps small enough that a long read is not one unbounded request.
        const STEP: usize = 8 << 20;
        let mut at = 0;
        while at < size as usize {
            let end = (at + STEP).min(memory.len());
            match file.read_at(&mut memory[at..end], at as u64) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(k) => at += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })
    .map_err(|e| std::io::Error::new(e.kind(), format!("cannot hold {} in memory: {e}", path.display())))
}
