//! The buffers bodies land in, used by the client (which fills them) and the prefetcher (which keeps
//! them): a [`Sink`] is where a fetched body is written as it arrives, a [`Body`] what a fetch returns,
//! [`Partial`]/[`Filling`] (`buffers/partial.rs`) a buffer whose verified prefix readers may read before
//! the rest has come, and [`BufferPool`] (`buffers/pool.rs`) the cache's byte budget and the buffers
//! reused within it.

use bytes::Bytes;

mod partial;
pub mod pool;
pub use partial::{FailedCheckpoint, Filling, Partial};
pub use pool::{Admission, BufferPool};

/// Where a fetched body is written as it arrives: a buffer (usually reused memory) whose verified
/// prefix readers may read, without a copy, before the rest has come ([`Partial`]), or a memory file
/// that the kernel can later serve reads and mmap faults from by itself (FUSE passthrough), written with
/// no buffer in between ([`MemoryFile`]), and released only whole.
pub enum Sink {
    Buffer(Filling),
    File(MemoryFile),
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sink::Buffer(b) => write!(f, "Sink::Buffer({} bytes)", b.len()),
            Sink::File(m) => write!(f, "Sink::File({} bytes)", m.len()),
        }
    }
}

impl Sink {
    /// An empty memory file for a body of `len` bytes (see [`crate::sys::memory_file`]).
    pub fn memory_file(len: u64) -> std::io::Result<Self> {
        Ok(Sink::File(MemoryFile::new(crate::sys::memory_file("batchfs-batch", len)?)))
    }

    /// An idle memory file filled again with a body of `len` bytes (see [`MemoryFile::recycled`]).
    pub fn recycled(file: std::fs::File, len: u64) -> std::io::Result<Self> {
        Ok(Sink::File(MemoryFile::recycled(file, len)?))
    }

    /// Bytes appended so far.
    pub fn len(&self) -> u64 {
        match self {
            Sink::Buffer(b) => b.len(),
            Sink::File(m) => m.len(),
        }
    }

    /// Whether nothing was appended yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Offers the response's checkpoints (see [`Filling::expect_checkpoints`]); a memory file is
    /// released only whole and ignores them.
    pub fn expect_checkpoints(&mut self, checkpoints: Vec<(u64, u32)>) -> bool {
        match self {
            Sink::Buffer(b) => b.expect_checkpoints(checkpoints),
            Sink::File(_) => false,
        }
    }

    /// Appends `data`, extending `crc` over it (and, into a buffer, checking the checkpoints reached:
    /// `InvalidData` when one does not match).
    pub fn append(&mut self, data: &Bytes, crc: &mut u32) -> std::io::Result<()> {
        match self {
            Sink::Buffer(b) => b.append(data, crc)?,
            Sink::File(m) => {
                *crc = batchfs::crc::crc32c_append(*crc, data);
                m.append(data.clone())?;
            }
        }
        Ok(())
    }
}

/// A memory file being filled. The body's pieces (the HTTP/2 frames as they came, held, not copied)
/// are written a huge page's span (2 MiB, aligned) at a time, in one `writev`: the kernel then fills
/// each huge page of the file with one copy, where a write of part of a page it has not filled yet
/// first zeroes the rest of it (6 % of the daemon's CPU with 128 KiB frames), and makes one system
/// call where it would make sixteen. [`MemoryFile::finish`] writes the rest.
///
/// A memory file filled again ([`MemoryFile::recycled`]) has its pages already: it is mapped, and the
/// body is received straight into the mapping ([`MemoryFile::spare`], [`MemoryFile::commit`]), one copy
/// where a fresh file takes two (or a copy and a zeroed page, had it been mapped).
pub struct MemoryFile {
    file: std::fs::File,
    /// Bytes written to the file.
    written: u64,
    /// Appended, not written yet: always short of the next span's end.
    pending: Vec<Bytes>,
    pending_len: u64,
    /// A recycled file's mapping, writable, of its whole new length.
    map: Option<memmap2::MmapMut>,
}

/// The span written at once: a transparent huge page (x86-64, arm64 with 4 KiB pages).
pub const WRITE_SPAN: u64 = 2 << 20;

impl MemoryFile {
    pub fn new(file: std::fs::File) -> Self {
        MemoryFile { file, written: 0, pending: Vec::new(), pending_len: 0, map: None }
    }

    /// The memory file `idle` (a read-only descriptor of the huge-page tmpfs) to be filled again with a
    /// body of `len` bytes: reopened writable, asked once more that no one else has it open or mapped,
    /// cut or grown to `len`, and mapped with its pages in place. Its old bytes stay until overwritten,
    /// so [`MemoryFile::finish`] cuts it to what was written.
    pub fn recycled(idle: std::fs::File, len: u64) -> std::io::Result<Self> {
        let file = crate::sys::reopen(&idle, true)?;
        drop(idle);
        if !crate::sys::unshared(&file)? {
            return Err(std::io::Error::other("the memory file is open or mapped elsewhere"));
        }
        file.set_len(len)?;
        if len == 0 {
            return Ok(MemoryFile::new(file));
        }
        // SAFETY: the file is this process's alone: no other descriptor or mapping of it exists (asked of
        // the kernel just now), it has no name, and the daemon hands it to no one before it is sealed, so
        // nothing else reads or writes its pages while this mapping lives.
        let map = unsafe { memmap2::MmapOptions::new().len(len as usize).populate().map_mut(&file)? };
        Ok(MemoryFile { map: Some(map), ..MemoryFile::new(file) })
    }

    /// Whether the body is received straight into the file's pages (a recycled file).
    pub fn is_recycled(&self) -> bool {
        self.map.is_some()
    }

    /// A recycled file's room for up to `max` more bytes, past what was written (empty at its end).
    pub fn spare(&mut self, max: usize) -> Option<&mut [u8]> {
        let at = self.written as usize;
        self.map.as_mut().map(|m| {
            let end = at.saturating_add(max).min(m.len());
            &mut m[at..end]
        })
    }

    /// Counts the next `n` bytes of [`MemoryFile::spare`]'s room as written, extending `crc` over them
    /// while they are in the CPU's caches.
    pub fn commit(&mut self, n: usize, crc: &mut u32) {
        if let Some(m) = &self.map {
            let at = self.written as usize;
            *crc = batchfs::crc::crc32c_append(*crc, &m[at..at + n]);
            self.written += n as u64;
        }
    }

    /// Bytes appended (written and pending).
    pub fn len(&self) -> u64 {
        self.written + self.pending_len
    }

    /// Whether nothing was appended yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn append(&mut self, mut data: Bytes) -> std::io::Result<()> {
        if let Some(room) = self.spare(data.len()) {
            if room.len() < data.len() {
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "the body runs past its size"));
            }
            room.copy_from_slice(&data);
            self.written += data.len() as u64;
            return Ok(());
        }
        while !data.is_empty() {
            let span_end = (self.written / WRITE_SPAN + 1) * WRITE_SPAN;
            let room = span_end - self.written - self.pending_len;
            if (data.len() as u64) < room {
                self.pending_len += data.len() as u64;
                self.pending.push(data);
                return Ok(());
            }
            // This piece reaches the span's end: the span goes out whole, the rest waits for the next.
            let rest = data.split_off(room as usize);
            self.pending_len += data.len() as u64;
            self.pending.push(data);
            self.write_pending()?;
            data = rest;
        }
        Ok(())
    }

    fn write_pending(&mut self) -> std::io::Result<()> {
        use std::io::{IoSlice, Write};
        let mut slices: Vec<IoSlice<'_>> = self.pending.iter().map(|b| IoSlice::new(b)).collect();
        let mut slices = &mut slices[..];
        while !slices.is_empty() {
            match (&self.file).write_vectored(slices) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut slices, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.written += self.pending_len;
        self.pending.clear();
        self.pending_len = 0;
        Ok(())
    }

    /// The file, with everything appended written to it (a recycled one unmapped and cut to it).
    pub fn finish(mut self) -> std::io::Result<std::fs::File> {
        if self.map.take().is_some() {
            if self.file.metadata()?.len() != self.written {
                self.file.set_len(self.written)?;
            }
            return Ok(self.file);
        }
        self.write_pending()?;
        Ok(self.file)
    }
}

/// A fetched body and the CRC32C of its bytes, computed as they arrived, while each piece was still
/// hot in the CPU cache (a second pass over a cold 7 MB body costs more).
#[derive(Debug)]
pub struct Body {
    pub sink: Sink,
    pub crc32c: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Read;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever the pieces' sizes, the file holds exactly the bytes appended, in order, and nothing
        /// is written but whole aligned spans until the end.
        #[test]
        fn a_memory_file_holds_its_pieces_and_is_written_in_whole_spans(
            sizes in proptest::collection::vec(0usize..(3 << 20), 0..8),
        ) {
            let body: Vec<u8> = (0..sizes.iter().sum::<usize>()).map(|i| (i * 7 % 251) as u8).collect();
            let mut m = MemoryFile::new(crate::sys::memfd("batchfs-test").unwrap());
            let mut at = 0;
            for n in sizes {
                m.append(Bytes::copy_from_slice(&body[at..at + n])).unwrap();
                at += n;
                prop_assert_eq!(m.written % WRITE_SPAN, 0, "only whole spans are written");
                prop_assert!(m.pending_len < WRITE_SPAN, "a full span is never held back");
                prop_assert_eq!(m.len(), at as u64);
                prop_assert_eq!(m.file.metadata().unwrap().len(), m.written);
            }
            let mut file = m.finish().unwrap();
            let mut all = Vec::new();
            std::io::Seek::rewind(&mut file).unwrap();
            file.read_to_end(&mut all).unwrap();
            prop_assert!(all == body, "the file is the body");
        }
    }
}
