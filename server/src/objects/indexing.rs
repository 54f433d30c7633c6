//! Indexing an object dataset: the [`Files`] a format's indexer reads, each object read once (whole, by
//! ranged GETs) and kept in the disk tier where the server has one; and the index kept in the bucket.

use super::etag::{self, Judged, Reads};
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
        if let Some(tier) = self.tier().filter(|t| t.on_disk(file.size) <= t.cap()) {
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
        let dir = Stage::new(&self.stage_dir)?;
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
    /// object's ETag vouches for it (its MD5, or a multipart upload's of a part size found: [`etag`]): what
    /// indexing reads instead of the store when a server starts again without its index (or with objects'
    /// dates changed), so a restart over a full tier reads nothing from the store. A copy that differs is
    /// removed; one its ETag cannot tell of (a multipart upload's of a part size not found) cannot be checked
    /// before an index exists, and the object is read from the store.
    fn held_copy(&self, file: &ShardInfo) -> Option<(PathBuf, batchfs::mmap::MappedFile)> {
        let tier = self.tier()?;
        let etag = file.etag.to_string();
        let name = self.tier_name(file);
        let (path, _) = tier.get(&name)?;
        let map = batchfs::mmap::MappedFile::open(&path).ok()?;
        let verdict = match map.bytes().len() as u64 == file.size {
            true => etag::verdict(&etag, map.bytes()),
            false => etag::Verdict::Differs,
        };
        match verdict {
            etag::Verdict::Matches => {
                // Indexed from these very bytes: the index they are checked against before serving agrees.
                tier.mark_checked(&name);
                Some((path, map))
            }
            // A multipart upload's of a part size not found: read from the store (a copy made anew).
            etag::Verdict::Unknown => None,
            etag::Verdict::Differs => {
                tier.remove(&name, "differs from its object's ETag");
                None
            }
        }
    }

    /// All of `file` by one GET, checked against its ETag (read again, up to [`FETCH_ATTEMPTS`] times, until
    /// one read is taken: [`Reads`]).
    async fn read_whole(&self, file: &ShardInfo) -> io::Result<Bytes> {
        let mut reads = Reads::default();
        for attempt in 1..=FETCH_ATTEMPTS {
            let bytes = self.get(u32::MAX, file, 0, file.size).await.map_err(ReadError::into_io)?;
            let etag = file.etag.to_string();
            let (bytes, judged, back) = tokio::task::spawn_blocking(move || {
                let judged = reads.judge(&etag, &bytes);
                (bytes, judged, reads)
            })
            .await
            .map_err(io::Error::other)?;
            reads = back;
            if self.taken(file, attempt, judged) {
                return Ok(bytes);
            }
        }
        Err(io::Error::new(io::ErrorKind::InvalidData, reads.refused(&self.bucket.url, file, FETCH_ATTEMPTS)))
    }

    /// Copies all of `file` into `out` (a file of its size, allocated on the disk) by ranged GETs of
    /// `object_part`, several at once, and checks the copy against the object's ETag; a copy that cannot be
    /// taken ([`Reads`]) is made again, up to [`FETCH_ATTEMPTS`] times.
    async fn copy_whole(&self, file: &ShardInfo, out: &std::fs::File) -> io::Result<()> {
        if file.size == 0 {
            return Ok(());
        }
        let mut reads = Reads::default();
        for attempt in 1..=FETCH_ATTEMPTS {
            self.write_whole(u32::MAX, file, super::stage::CopyOut::cached(out), |e| e, false, None).await?;
            // SAFETY: the file was made by this server, in a directory of its own, and nothing else writes
            // it; the mapping only reads, and is dropped before the file is used.
            let copy = unsafe { memmap2::Mmap::map(out)? };
            let judged = reads.judge(&file.etag.to_string(), &copy);
            if self.taken(file, attempt, judged) {
                return Ok(());
            }
        }
        Err(io::Error::new(io::ErrorKind::InvalidData, reads.refused(&self.bucket.url, file, FETCH_ATTEMPTS)))
    }

    /// Whether read `attempt` of `file`, `judged` so, is taken; a corrupted one counted and logged, and the
    /// first object of the dataset read twice because its ETag cannot tell said once.
    fn taken(&self, file: &ShardInfo, attempt: u32, judged: Judged) -> bool {
        let (dataset, object) = (&self.bucket.url, &file.path);
        match judged {
            Judged::Take => return true,
            Judged::Again { corrupt: true } => {
                self.counters.bad_checksums.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%dataset, %object, attempt, "the copy read differs from its ETag, or from the \
                    earlier reads where the ETag cannot tell: read again");
            }
            Judged::Again { corrupt: false } if !self.unvouched_noted.swap(true, Ordering::Relaxed) => {
                tracing::info!(%dataset, %object, etag = %file.etag, "a multipart upload of a part size not found \
                    (its ETag cannot vouch for the bytes read): such objects are read twice while indexed, and \
                    taken once two reads agree");
            }
            Judged::Again { .. } => {
                tracing::debug!(%dataset, %object, "its ETag cannot vouch for the bytes read: read again to compare");
            }
        }
        false
    }

    /// Keeps `bytes` (all of `file`, checked) in the disk tier, where there is one; a copy the disk
    /// refuses is only logged (the object is then read from the store).
    fn keep_copy(&self, file: &ShardInfo, bytes: &[u8]) {
        let Some(tier) = self.tier().filter(|t| t.on_disk(file.size) <= t.cap()) else { return };
        let kept = tier.begin(&self.tier_name(file), file.size).and_then(|copy| {
            copy.file().write_all_at(bytes, 0).map_err(|e| copy.failed(e))?;
            copy.commit()
        });
        if let Err(e) = kept {
            tracing::debug!(dataset = %self.bucket.url, error = %e, "not kept in the disk tier");
        }
    }
}

/// A staging directory's name's start in a shared directory (`index_dir`, or `$TMPDIR`).
const STAGE_PREFIX: &str = "batchfs-stage-";
/// A staging directory's name while it is made, before its lock is taken (never swept while young).
const STAGE_MAKING: &str = ".batchfs-staging-";
/// The lock file in each staging directory, held (`flock`) by the server staging there while it lives.
const STAGE_LOCK: &str = ".lock";
/// How old a staging directory without a held lock must be to be taken for a dead one's where it cannot
/// be told by its lock (one being made, or one a build before the locks made).
const UNLOCKED_STAGE_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// A staging directory of this server, removed when dropped. Its lock file is held with `flock` while
/// it lives, which the kernel lets go however the server ends: a server's start removes the directories
/// whose lock it can take ([`remove_dead_stages`]), and no live server's, whatever host or pid namespace
/// it runs in (an `index_dir` on a shared filesystem; a restarted container's server is pid 1 again).
pub(super) struct Stage {
    path: PathBuf,
    _lock: Option<std::fs::File>,
}

impl Stage {
    /// A new staging directory in `dir`: made under a name the sweep leaves alone, locked, then renamed
    /// to a staging directory's name (the lock follows the file), so none is ever seen unlocked.
    pub(super) fn new(dir: &Path) -> io::Result<Stage> {
        std::fs::create_dir_all(dir)?;
        let made = tempfile::Builder::new().prefix(STAGE_MAKING).tempdir_in(dir)?.keep();
        let suffix = made.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix(STAGE_MAKING));
        let path = dir.join(format!("{STAGE_PREFIX}{}", suffix.unwrap_or_default()));
        let lock = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(made.join(STAGE_LOCK));
        // A filesystem without locks (ENOLCK): the directory is staged in unlocked, and no sweep can take
        // its lock either, so none removes it.
        let lock = lock.and_then(|file| flock(&file, libc::LOCK_EX).map(|()| file));
        let renamed = std::fs::rename(&made, &path);
        if let Err(e) = renamed {
            let _ = std::fs::remove_dir_all(&made);
            return Err(e);
        }
        Ok(Stage { path, _lock: lock.ok() })
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        // Removed while still locked: no sweep sees it half removed and unlocked.
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// `flock(file, how | LOCK_NB)`: a lock of the open file, not waited for.
fn flock(file: &std::fs::File, how: libc::c_int) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock takes a descriptor this function's caller holds open; no memory is passed.
    match unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Removes the staging directories in `dir` of servers no longer running (killed while indexing: a
/// whole object each, left behind): those whose lock this process can take, and those without a lock
/// older than [`UNLOCKED_STAGE_AGE`]. A live server's, its lock held, stays. Returns how many.
pub(super) fn remove_dead_stages(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let old = |entry: &std::fs::DirEntry| {
        let modified = entry.metadata().and_then(|m| m.modified()).ok();
        modified.and_then(|t| t.elapsed().ok()).is_some_and(|age| age > UNLOCKED_STAGE_AGE)
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let dead = if name.starts_with(STAGE_PREFIX) {
            let lock = std::fs::OpenOptions::new().read(true).write(true).open(entry.path().join(STAGE_LOCK));
            match lock {
                // Taken: its server is gone (the lock is let go as the directory is removed).
                Ok(file) => flock(&file, libc::LOCK_EX).is_ok(),
                Err(e) if e.kind() == io::ErrorKind::NotFound => old(&entry),
                Err(_) => false,
            }
        } else {
            name.starts_with(STAGE_MAKING) && old(&entry)
        };
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
    /// no start removed; now the next start removes those whose lock is let go, and never a live one's (its
    /// lock held: this process's own here, as a restarted container's server may have the dead one's pid).
    #[test]
    fn staging_directories_of_dead_servers_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let live = Stage::new(dir.path()).unwrap();
        std::fs::write(live.path().join("object"), b"staged").unwrap();
        // A dead server's: its lock file, let go as the server ended.
        let dead_path = dir.path().join(format!("{STAGE_PREFIX}dead"));
        std::fs::create_dir(&dead_path).unwrap();
        std::fs::write(dead_path.join(STAGE_LOCK), b"").unwrap();
        std::fs::write(dead_path.join("object"), b"staged").unwrap();
        for name in ["batchfs-stage-young-unlocked", ".batchfs-staging-young", "other"] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
        }
        assert_eq!(remove_dead_stages(dir.path()), 1);
        let mut left: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        let live_name = live.path().file_name().unwrap().to_str().unwrap().to_owned();
        let mut kept =
            vec![live_name, "batchfs-stage-young-unlocked".into(), ".batchfs-staging-young".into(), "other".into()];
        kept.sort();
        assert_eq!(left, kept);
        assert!(live.path().join("object").exists() && !dead_path.exists());
        // Dropped, a stage is removed.
        let path = live.path().to_owned();
        drop(live);
        assert!(!path.exists());
    }
}
