//! A body's copies checked again on a client's word: a mount whose body failed its checksum retries it
//! saying so (`x-batchfs-recheck`, docs/API.md), and the copies in the disk tier that the body reads are
//! checked against the index over the 4 MiB chunks it reads before it is sent, as a copy found at start
//! is checked whole. A copy that differs (rotted on its disk, or written over under the running server)
//! is dropped, logged with its object and chunk and counted (`batchfs_tier_failures_total`), and the body
//! reads the store. Before, such a copy was served until a restart: every retry got the same bad bytes,
//! and the mount's read failed with `EIO` at its `timeout` while the server said nothing. Without the
//! header nothing is checked here (a copy was checked when made, or once after a restart).

use super::ObjectSource;
use batchfs::index::CHUNK_BYTES;
use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::os::unix::fs::FileExt;

impl ObjectSource {
    /// Checks the chunks of the tier's copies that `ranges` (`(object, offset, len)`) read against the
    /// index, dropping a copy that differs or cannot be read. Copies not checked yet in this process are
    /// left to their first read, which checks them whole. Blocks: call on the blocking pool.
    pub fn recheck_copies(&self, ranges: &[(u32, u64, u64)]) {
        let Some(tier) = self.tier() else { return };
        let mut chunks: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
        for &(n, offset, len) in ranges.iter().filter(|r| r.2 > 0) {
            chunks.entry(n).or_default().extend(offset / CHUNK_BYTES..=(offset + len - 1) / CHUNK_BYTES);
        }
        for (n, chunks) in chunks {
            let Some(file) = self.file(n) else { continue };
            let name = self.tier_name(file);
            let Some((path, true)) = tier.get(&name) else { continue };
            let differs = std::fs::File::open(&path).and_then(|copy| {
                let mut buffer = vec![0; CHUNK_BYTES.min(file.size) as usize];
                for k in chunks.into_iter().filter(|&k| k * CHUNK_BYTES < file.size) {
                    let at = k * CHUNK_BYTES;
                    let piece = &mut buffer[..(file.size - at).min(CHUNK_BYTES) as usize];
                    copy.read_exact_at(piece, at)?;
                    if file.chunk_crc(k) != Some(batchfs::crc::crc32c(piece)) {
                        return Ok(Some(format!("chunk {k} differs from the index")));
                    }
                }
                Ok(None)
            });
            let why = match differs {
                Ok(None) => continue,
                Ok(Some(why)) => why,
                Err(e) => format!("cannot be read: {e}"),
            };
            let object = self.shown(file);
            let why = format!("{}: {why}, found on a client's retry after a checksum failure", object.display());
            tier.remove(&name, &why);
        }
    }
}
