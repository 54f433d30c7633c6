//! `raw/`, the dataset's own files, as the prefetcher sees them: each directory listed once from the
//! server (every page), when first looked into, and kept as a listing of chunks (`listings.rs`): a file of
//! one chunk is fetched whole like a batch; a larger one chunk by chunk, each a range checked against its
//! own CRC32C, so a shard larger than the cache streams through it. Reads within a file cross chunks here.

use super::listings::Raw;
use super::retry::{with_retries, Failure};
use super::{BatchKey, Listing, Prefetcher, ReadError};
use crate::sync::Arc;
use batchfs::api::FileList;
use bytes::Bytes;

impl Prefetcher {
    /// Directory `path` of the dataset's files (`""`: the top): its id and its list, every page fetched
    /// once, when first asked for, with retries up to `timeout`. Blocks like [`Prefetcher::manifest`].
    pub fn list_dir(&self, path: &str) -> Result<(u32, Arc<FileList>), ReadError> {
        if let Some((id, raw)) = self.listings.raw_at(path) {
            return Ok((id, raw.files));
        }
        let list = self.runtime.block_on(async {
            let mut merged: Option<FileList> = None;
            let mut cursor = 0;
            loop {
                let (client, dir) = (self.client.clone(), path.to_owned());
                let page = with_retries(&self.config, &self.stats, move |_| {
                    let (client, dir) = (client.clone(), dir.clone());
                    async move { client.files(&dir, cursor).await.map_err(Failure::Client) }
                })
                .await?;
                let next = page.next;
                match &mut merged {
                    None => merged = Some(page),
                    Some(all) => {
                        for d in page.dirs {
                            // A subdirectory spanning two pages is named on both.
                            if all.dirs.last() != Some(&d) {
                                all.dirs.push(d);
                            }
                        }
                        all.files.extend(page.files);
                    }
                }
                // A cursor that does not move on would never end.
                match next {
                    Some(n) if n > cursor => cursor = n,
                    _ => break,
                }
            }
            Ok::<_, ReadError>(merged.expect("one page at least"))
        })?;
        let (id, raw) = self.listings.put_raw(list);
        Ok((id, raw.files))
    }

    /// The size of file `file` of directory `dir` of `raw/`.
    pub fn file_size(&self, dir: u32, file: u64) -> Result<u64, ReadError> {
        let raw = self.raw(dir)?;
        raw.files
            .files
            .get(file as usize)
            .map(|f| f.size)
            .ok_or_else(|| ReadError::NotFound(format!("source file #{file}")))
    }

    /// Directory `dir` of `raw/`, listed before.
    pub(super) fn raw(&self, dir: u32) -> Result<Raw, ReadError> {
        self.listings.raw(dir).ok_or_else(|| ReadError::NotFound(format!("raw directory #{dir}")))
    }

    /// The chunks of file `file` of directory `dir` (its position in [`Prefetcher::list_dir`]'s list):
    /// the indices of its [`Listing::Raw`] keys, one for a file fetched whole.
    pub fn file_chunks(&self, dir: u32, file: u64) -> Result<std::ops::Range<u64>, ReadError> {
        self.raw(dir)?.chunks_of(file).ok_or_else(|| ReadError::NotFound(format!("source file #{file}")))
    }

    /// Reads `[offset, offset + size)` of file `file` of directory `dir`, chunk after chunk (each verified
    /// before any of its bytes is returned; a sequential reader's next chunks are prefetched like
    /// batches).
    pub fn read_file(
        self: &Arc<Self>,
        dir: u32,
        file: u64,
        offset: u64,
        size: u32,
        owner: u32,
    ) -> Result<Bytes, ReadError> {
        let raw = self.raw(dir)?;
        let chunks = raw.chunks_of(file).ok_or_else(|| ReadError::NotFound(format!("source file #{file}")))?;
        let chunk_bytes = raw.files.chunk_bytes;
        let file_size = raw.files.files[file as usize].size;
        let end = offset.saturating_add(u64::from(size)).min(file_size);
        let single = chunks.end - chunks.start == 1;
        let mut out: Option<bytes::BytesMut> = None;
        let mut at = offset;
        while at < end {
            let (chunk, within) = if single { (0, at) } else { (at / chunk_bytes, at % chunk_bytes) };
            let key = BatchKey { listing: Listing::Raw { dir }, index: chunks.start + chunk };
            let got = self.read(key, within, (end - at).min(u64::from(u32::MAX)) as u32, owner)?;
            if got.is_empty() {
                break;
            }
            at += got.len() as u64;
            match &mut out {
                // The common case, a read within one chunk: its bytes as they are, no copy.
                None if at >= end => return Ok(got),
                None => out = Some(bytes::BytesMut::from(&got[..])),
                Some(out) => out.extend_from_slice(&got),
            }
        }
        Ok(out.map_or_else(Bytes::new, bytes::BytesMut::freeze))
    }
}
