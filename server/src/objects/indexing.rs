//! Indexing an object dataset: the [`Files`] a format's indexer reads, each object read once (whole, by
//! ranged GETs) and kept in the disk tier where the server has one; and the index kept in the bucket.

use super::{ObjectSource, ReadError, FETCH_ATTEMPTS};
use batchfs::index::ShardInfo;
use batchfs::source::{Files, Local};
use bytes::Bytes;
use futures_util::StreamExt;
use object_store::ObjectStoreExt;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

/// Whether `bytes` have the MD5 that `etag` is, where it is one (else nothing to check them against).
fn matches_etag(etag: &str, bytes: &[u8]) -> bool {
    use md5::Digest;
    etag_md5(etag).is_none_or(|want| md5::Md5::digest(bytes)[..] == want)
}

fn differs_from_etag(url: &str, file: &ShardInfo) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{url}/{}: every copy read differs from the object's MD5 (its ETag)", file.path),
    )
}

/// The MD5 an ETag is, where it is one (a single-part upload's: 32 hex digits, quoted).
fn etag_md5(etag: &str) -> Option<[u8; 16]> {
    let hex = etag.trim_matches('"');
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The name of the index kept beside the data in the bucket (hidden: never listed as a file).
const INDEX_OBJECT: &str = batchfs::source::INDEX_FILE_NAME;

impl Files for ObjectSource {
    fn root(&self) -> &Path {
        &self.shown
    }

    fn kept_index(&self) -> Option<Vec<u8>> {
        if !self.index_in_bucket {
            return None;
        }
        let at = self.bucket.location(INDEX_OBJECT);
        let read = self
            .context
            .block_here(async { ObjectStoreExt::get(self.bucket.store.as_ref(), &at).await?.bytes().await });
        match read {
            Ok(bytes) => Some(bytes.to_vec()),
            Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => {
                tracing::warn!(dataset = %self.bucket.url, error = %e, "cannot read the index kept in the bucket");
                None
            }
        }
    }

    fn keep_index(&self, index: &[u8]) -> io::Result<bool> {
        if !self.index_in_bucket {
            return Ok(false);
        }
        let (at, payload) = (self.bucket.location(INDEX_OBJECT), bytes::Bytes::copy_from_slice(index).into());
        self.context
            .block_here(async { ObjectStoreExt::put(self.bucket.store.as_ref(), &at, payload).await })
            .map_err(|e| io::Error::other(format!("{}/{INDEX_OBJECT}: {e}", self.bucket.url)))?;
        Ok(true)
    }

    /// A copy of `file` on local disk: made in the disk tier and kept there, where the server has one
    /// (linked under the object's own name in a directory of its own, for LMDB), else made in
    /// `index_dir` and removed once indexed.
    fn local(&self, file: &ShardInfo) -> io::Result<Local> {
        let name = file.path.rsplit('/').next().unwrap_or(&file.path);
        if let Some(tier) = self.tier().filter(|t| file.size <= t.cap()) {
            // A copy the tier holds already (a restart that indexes again): linked, not read from the store.
            if let Some((held, _)) = self.held_copy(file) {
                let dir = tempfile::Builder::new().prefix("batchfs-stage-").tempdir_in(tier.dir().join("staging"))?;
                let path = dir.path().join(name);
                std::fs::hard_link(held, &path)?;
                return Ok(Local { path, staged: Some(Box::new(dir)) });
            }
            let kept = || -> io::Result<Local> {
                let dir = tempfile::Builder::new().prefix("batchfs-stage-").tempdir_in(tier.dir().join("staging"))?;
                let copy = tier.begin(&self.tier_name(file), file.size)?;
                self.context.block_here(self.copy_whole(file, copy.file()))?;
                let path = dir.path().join(name);
                std::fs::hard_link(copy.commit()?, &path)?;
                Ok(Local { path, staged: Some(Box::new(dir)) })
            };
            match kept() {
                Ok(local) => return Ok(local),
                // A disk tier that cannot take it (full, failing): a copy of the indexing's own, as without.
                Err(e) => tracing::warn!(dataset = %self.bucket.url, object = %file.path, error = %e,
                    "not kept in the disk tier: staged apart while indexed"),
            }
        }
        std::fs::create_dir_all(&self.stage_dir)?;
        let dir = tempfile::Builder::new().prefix(&stage_prefix(std::process::id())).tempdir_in(&self.stage_dir)?;
        let path = dir.path().join(name);
        let out = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
        super::tier::allocate(&out, file.size)?;
        self.context.block_here(self.copy_whole(file, &out))?;
        Ok(Local { path, staged: Some(Box::new(dir)) })
    }

    /// Many objects at once (`object_requests`, at most 64), each one GET, checked against its ETag's
    /// MD5 where it is one, kept in memory only until `each` has seen it. Objects larger than
    /// `object_part` are staged as [`Files::local`] does.
    fn read_each(
        &self,
        files: &[ShardInfo],
        each: &mut batchfs::source::EachFile,
    ) -> Result<(), batchfs::source::IndexError> {
        let io_err = |file: &ShardInfo| {
            let path = self.shown.join(&file.path);
            move |source| batchfs::source::IndexError::Io { path, source }
        };
        let (small, large): (Vec<usize>, Vec<usize>) =
            (0..files.len()).partition(|&i| files[i].size <= self.limits().part);
        // Small objects the tier holds a copy of are read from there, not from the store.
        let mut fetched = Vec::with_capacity(small.len());
        for i in small {
            match self.held_copy(&files[i]) {
                // The mapping its check read: the copy is not read a second time.
                Some((_, map)) => each(i, map.bytes())?,
                None => fetched.push(i),
            }
        }
        let small = fetched;
        for i in large {
            let local = self.local(&files[i]).map_err(io_err(&files[i]))?;
            let map = batchfs::mmap::MappedFile::open(&local.path).map_err(io_err(&files[i]))?;
            each(i, map.bytes())?;
        }
        let window = self.limits().requests.clamp(1, 64);
        let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, io::Result<Bytes>)>(window);
        std::thread::scope(|s| {
            // The sender moves into the thread: when the reads end, so does the loop below.
            let reads = s.spawn(move || {
                self.context.block_on(async {
                    let mut reads = futures_util::stream::iter(small)
                        .map(|i| async move { (i, self.read_whole(&files[i]).await) })
                        .buffer_unordered(window);
                    while let Some(done) = reads.next().await {
                        if tx.send(done).is_err() {
                            return;
                        }
                    }
                })
            });
            let mut result = Ok(());
            for (i, read) in rx.iter() {
                if let Ok(bytes) = &read {
                    self.keep_copy(&files[i], bytes);
                }
                result = read.map_err(io_err(&files[i])).and_then(|bytes| each(i, &bytes));
                if result.is_err() {
                    break;
                }
            }
            drop(rx);
            reads.join().expect("the reads panicked");
            result
        })
    }
}

impl ObjectSource {
    /// The disk tier's copy of `file` (its path, and the mapping its check read), where it holds one and the
    /// object's ETag is the MD5 of its bytes (a single-part upload's) and the copy has them: what indexing
    /// reads instead of the store when a server starts again without its index (or with objects' dates
    /// changed), so a restart over a full tier reads nothing from the store. A copy that differs is removed; an
    /// object whose ETag is no MD5 (a multipart upload's) cannot be checked before an index exists, and is read
    /// from the store.
    fn held_copy(&self, file: &ShardInfo) -> Option<(PathBuf, batchfs::mmap::MappedFile)> {
        let tier = self.tier()?;
        let etag = file.etag.to_string();
        etag_md5(&etag)?;
        let name = self.tier_name(file);
        let (path, _) = tier.get(&name)?;
        let map = batchfs::mmap::MappedFile::open(&path).ok()?;
        if map.bytes().len() as u64 == file.size && matches_etag(&etag, map.bytes()) {
            // Indexed from these very bytes: the index they are checked against before serving agrees.
            tier.mark_checked(&name);
            return Some((path, map));
        }
        tier.remove(&name, "differs from its object's MD5 (its ETag)");
        None
    }

    /// All of `file` by one GET, checked against its ETag's MD5 where it is one (read again, up to
    /// [`FETCH_ATTEMPTS`] times, where it differs).
    async fn read_whole(&self, file: &ShardInfo) -> io::Result<Bytes> {
        for _ in 0..FETCH_ATTEMPTS {
            let bytes = self.get(u32::MAX, file, 0, file.size).await.map_err(ReadError::into_io)?;
            let etag = file.etag.clone();
            let (bytes, good) = tokio::task::spawn_blocking(move || {
                let good = matches_etag(&etag.to_string(), &bytes);
                (bytes, good)
            })
            .await
            .map_err(io::Error::other)?;
            if good {
                return Ok(bytes);
            }
            self.counters.bad_checksums.fetch_add(1, Ordering::Relaxed);
        }
        Err(differs_from_etag(&self.bucket.url, file))
    }

    /// Copies all of `file` into `out` (a file of its size, allocated on the disk) by ranged GETs of
    /// `object_part`, several at once, and checks the copy against the object's ETag where that is its MD5
    /// (a single-part upload); a copy that does not match is made again, up to [`FETCH_ATTEMPTS`] times.
    async fn copy_whole(&self, file: &ShardInfo, out: &std::fs::File) -> io::Result<()> {
        if file.size == 0 {
            return Ok(());
        }
        for attempt in 1..=FETCH_ATTEMPTS {
            self.write_whole(u32::MAX, file, super::stage::CopyOut::cached(out), |e| e, false, None).await?;
            // SAFETY: the file was made by this server, in a directory of its own, and nothing else writes
            // it; the mapping only reads, and is dropped before the file is used.
            let copy = unsafe { memmap2::Mmap::map(out)? };
            if matches_etag(&file.etag.to_string(), &copy) {
                return Ok(());
            }
            self.counters.bad_checksums.fetch_add(1, Ordering::Relaxed);
            let object = &file.path;
            tracing::warn!(dataset = %self.bucket.url, %object, attempt, "the copy read does not match the ETag's MD5");
        }
        Err(differs_from_etag(&self.bucket.url, file))
    }

    /// Keeps `bytes` (all of `file`, checked) in the disk tier, where there is one; a copy the disk
    /// refuses is only logged (the object is then read from the store).
    fn keep_copy(&self, file: &ShardInfo, bytes: &[u8]) {
        let Some(tier) = self.tier().filter(|t| file.size <= t.cap()) else { return };
        let kept = tier.begin(&self.tier_name(file), file.size).and_then(|copy| {
            copy.file().write_all_at(bytes, 0).map_err(|e| copy.failed(e))?;
            copy.commit()
        });
        if let Err(e) = kept {
            tracing::debug!(dataset = %self.bucket.url, error = %e, "not kept in the disk tier");
        }
    }
}

/// The name's start of a staging directory of process `pid` in a shared directory (`index_dir`, or
/// `$TMPDIR`): host and pid say whose it is, so that the next start removes a dead server's of this
/// host and no other's (an `index_dir` on a shared filesystem is seen by other hosts, whose pids mean
/// nothing here).
fn stage_prefix(pid: u32) -> String {
    format!("batchfs-stage-{}-{pid}-", host())
}

/// This host's name, as a file name's part (`localhost` where it cannot be read).
fn host() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String =
        name.trim().chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// Removes the staging directories in `dir` of servers no longer running (killed while indexing: a
/// whole object each, left behind), leaving those of live processes, whoever they are, and those of
/// other hosts. Returns how many.
pub(super) fn remove_dead_stages(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let ours = format!("batchfs-stage-{}-", host());
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(&ours)).and_then(|rest| {
            let (pid, _) = rest.split_once('-')?;
            pid.parse::<u32>().ok()
        }) else {
            continue;
        };
        let dead = !std::path::Path::new(&format!("/proc/{pid}")).exists();
        if dead && std::fs::remove_dir_all(entry.path()).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(dir = %dir.display(), removed, "removed what servers killed while indexing left");
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server killed while indexing without a tier left a whole object in a staging directory, which
    /// no start removed; now the next start removes a dead server's, and never a live process's.
    #[test]
    fn staging_directories_of_dead_servers_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (dead, live) = (stage_prefix(99_999_999), stage_prefix(std::process::id()));
        let elsewhere = "batchfs-stage-another.host-99999999-ghi".to_string();
        let names =
            [format!("{dead}abc"), format!("{live}def"), elsewhere.clone(), "batchfs-stage-xyz".into(), "other".into()];
        for name in names {
            std::fs::create_dir(dir.path().join(&name)).unwrap();
            std::fs::write(dir.path().join(name).join("object"), b"staged").unwrap();
        }
        assert_eq!(remove_dead_stages(dir.path()), 1);
        let mut left: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        let mut kept = vec![format!("{live}def"), elsewhere, "batchfs-stage-xyz".into(), "other".into()];
        kept.sort();
        assert_eq!(left, kept);
    }

    #[test]
    fn only_a_single_part_etag_is_an_md5() {
        assert_eq!(
            etag_md5("\"d41d8cd98f00b204e9800998ecf8427e\""),
            Some(*b"\xd4\x1d\x8c\xd9\x8f\x00\xb2\x04\xe9\x80\x09\x98\xec\xf8\x42\x7e")
        );
        assert_eq!(etag_md5("\"d41d8cd98f00b204e9800998ecf8427e-3\""), None);
        assert_eq!(etag_md5("W/\"xyz\""), None);
        assert_eq!(etag_md5(""), None);
    }
}
