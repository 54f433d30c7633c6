//! What `raw/` tells the prefetcher: a listing is one directory (its part the id the prefetcher gave its
//! list), its objects the chunks of its files, file after file. A file of one chunk is fetched whole
//! (`GET .../files/PATH`) and may be handed to the kernel by passthrough; a larger one chunk by chunk, each a
//! range checked against its own CRC32C, so a shard larger than the cache streams through it. In the node
//! cache a chunk is itself, or a range of its whole file (as warming keeps it). Windows are `prefetch`
//! files (a file tree's files are single samples) and stay in the directory; the first read of a DALI index
//! asks for every other index of its directory. Reads within a file cross chunks here.

use crate::client::Request;
use crate::prefetch::kinds::{Follow, Kind, Object, Objects, OnDisk};
use crate::prefetch::{Listing, ObjectKey, Prefetcher, Raw, ReadError};
use bytes::Bytes;
use std::sync::Arc;

/// The kind of `raw/`'s listings.
pub struct RawChunks {
    name: &'static str,
}

pub static CHUNKS: RawChunks = RawChunks { name: "raw/" };

/// Chunk `index` of directory `dir`.
pub fn key(dir: u32, index: u64) -> ObjectKey {
    ObjectKey { listing: Listing::new(&CHUNKS, 0, dir.into()), index }
}

impl Kind for RawChunks {
    fn name(&self) -> &'static str {
        self.name
    }

    fn describe(&self, listing: Listing, index: u64) -> String {
        format!("chunk #{index} of raw directory #{}", listing.part)
    }

    fn objects(&self, p: &Prefetcher, listing: Listing) -> Result<Arc<dyn Objects>, ReadError> {
        Ok(Arc::new(Chunks(p.raw_dir(listing.part as u32)?)))
    }

    fn follow(&self, _listing: Listing) -> Follow {
        Follow { streams: true, by_bytes: false, all_at_first: false, into_next_epoch: false }
    }
}

/// A directory's chunks.
struct Chunks(Raw);

impl Objects for Chunks {
    fn count(&self) -> u64 {
        self.0.chunks.len() as u64
    }

    fn bytes(&self) -> u64 {
        self.0.bytes
    }

    fn object(&self, index: u64) -> Option<Object> {
        let sent = *self.0.chunks.get(index as usize)?;
        let whole = self.0.chunk(index).is_some_and(|(file, _)| file.size == sent.bytes);
        Some(Object { sent, placed: None, whole })
    }

    fn request(&self, index: u64) -> Option<Request> {
        self.0.chunk(index).map(|(file, offset)| Request::File { path: file.path.clone(), offset })
    }

    fn on_disk(&self, index: u64, obj: &Object) -> Option<OnDisk> {
        let (file, offset) = self.0.chunk(index)?;
        let whole = crate::node_cache::Key::whole(file);
        // A file of one chunk is that chunk; a larger one's chunk may be kept alone, or within the file.
        if whole.sent == obj.sent {
            return Some(OnDisk { pieces: vec![whole], within: None });
        }
        let chunk = crate::node_cache::Key::chunk(obj.sent, whole, offset);
        Some(OnDisk { pieces: vec![chunk], within: Some((whole, offset)) })
    }

    fn also_after(&self, index: u64) -> Vec<u64> {
        self.0.indexes_at(index)
    }
}

/// Reads `[offset, offset + size)` of file `file` of directory `dir`, chunk after chunk (each verified
/// before any of its bytes is returned; a sequential reader's next chunks are prefetched like batches).
pub fn read_file(
    p: &Arc<Prefetcher>,
    (dir, file): (u32, u64),
    offset: u64,
    size: u32,
    owner: u32,
) -> Result<Bytes, ReadError> {
    let raw = p.raw_dir(dir)?;
    let chunks = raw.chunks_of(file).ok_or_else(|| ReadError::NotFound(format!("source file #{file}")))?;
    let chunk_bytes = raw.files.chunk_bytes;
    let file_size = raw.files.files[file as usize].size;
    let end = offset.saturating_add(u64::from(size)).min(file_size);
    let single = chunks.end - chunks.start == 1;
    let mut out: Option<bytes::BytesMut> = None;
    let mut at = offset;
    while at < end {
        let (chunk, within) = if single { (0, at) } else { (at / chunk_bytes, at % chunk_bytes) };
        let got = p.read(key(dir, chunks.start + chunk), within, (end - at).min(u64::from(u32::MAX)) as u32, owner)?;
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
