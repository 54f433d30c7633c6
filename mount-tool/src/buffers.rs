//! The buffers bodies land in, used by the client (which fills them) and the prefetcher (which keeps
//! them): a [`Sink`] is where a fetched body is written as it arrives, a [`Body`] what a fetch returns,
//! [`Partial`]/[`Filling`] (`buffers/partial.rs`) a buffer whose verified prefix readers may read before
//! the rest has come, and [`BufferPool`] (`buffers/pool.rs`) the cache's byte budget and the buffers
//! reused within it.

mod partial;
pub mod pool;
pub use partial::{Filling, Partial};
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
        Ok(Sink::File(MemoryFile::new(crate::sys::memory_file("batchfs-batch", len)?, len)?))
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
    /// `InvalidData` when one does not match); past the body's announced size, `InvalidData`.
    pub fn append(&mut self, data: &[u8], crc: &mut u32) -> std::io::Result<()> {
        match self {
            Sink::Buffer(b) => b.append(data, crc)?,
            Sink::File(m) => m.append(data, crc)?,
        }
        Ok(())
    }

    /// Room for up to `want` more bytes of the body (fewer at its announced end), for a receiver to read
    /// them into directly; [`Sink::commit`] then takes what it read. Nothing in the room is released to
    /// any reader before it is committed and verified.
    pub fn spare(&mut self, want: usize) -> std::io::Result<tokio::io::ReadBuf<'_>> {
        Ok(match self {
            Sink::Buffer(b) => tokio::io::ReadBuf::uninit(b.spare(want)),
            Sink::File(m) => tokio::io::ReadBuf::new(m.spare(want)?),
        })
    }

    /// The first `n` bytes of the last [`Sink::spare`] were filled: as [`Sink::append`] of them, without
    /// the copy.
    pub fn commit(&mut self, n: usize, crc: &mut u32) -> std::io::Result<()> {
        match self {
            Sink::Buffer(b) => b.commit(n, crc),
            Sink::File(m) => {
                m.commit(n, crc);
                Ok(())
            }
        }
    }
}

/// A memory file being filled, through a shared mapping of it: a body is received straight into its
/// pages (see [`Sink::spare`]), the kernel's one copy out of the socket, or copied there by
/// [`Sink::append`]. Each span of the mapping is populated (its pages allocated) in one call before it is
/// written, [`POPULATE_SPAN`] at a time, not faulted in page by page. [`MemoryFile::finish`] unmaps it,
/// so the file can be sealed.
pub struct MemoryFile {
    file: std::fs::File,
    /// The file's mapping, as long as the body (none for an empty body).
    map: Option<memmap2::MmapMut>,
    /// Bytes written.
    written: u64,
    /// Bytes of the mapping populated.
    populated: u64,
}

/// The span populated at once: a transparent huge page (x86-64, arm64 with 4 KiB pages), which the
/// huge-page tmpfs gives each aligned span of a file.
pub const POPULATE_SPAN: u64 = 2 << 20;

impl MemoryFile {
    /// `file`, made `len` bytes long, to be filled from its start.
    pub fn new(file: std::fs::File, len: u64) -> std::io::Result<Self> {
        file.set_len(len)?;
        // SAFETY: the file is a memory file of this process's own (a memfd, or an unlinked file on its
        // private tmpfs) that nothing else maps or truncates while this mapping lives: it is sealed or
        // reopened read-only only after `finish` unmaps it.
        let map = if len == 0 { None } else { Some(unsafe { memmap2::MmapOptions::new().map_mut(&file)? }) };
        Ok(MemoryFile { file, map, written: 0, populated: 0 })
    }

    /// Bytes written.
    pub fn len(&self) -> u64 {
        self.written
    }

    /// Whether nothing was written yet.
    pub fn is_empty(&self) -> bool {
        self.written == 0
    }

    /// Up to `want` bytes of room past what is written, populated.
    fn spare(&mut self, want: usize) -> std::io::Result<&mut [u8]> {
        let Some(map) = self.map.as_mut() else { return Ok(&mut []) };
        let size = map.len() as u64;
        let end = (self.written + want as u64).min(size);
        if end > self.populated {
            let to = end.div_ceil(POPULATE_SPAN).saturating_mul(POPULATE_SPAN).min(size);
            crate::sys::populate_write(&mut map[self.populated as usize..to as usize]);
            self.populated = to;
        }
        Ok(&mut map[self.written as usize..end as usize])
    }

    /// The next `n` bytes were written into [`MemoryFile::spare`]'s room: extends `crc` over them.
    fn commit(&mut self, n: usize, crc: &mut u32) {
        let map = self.map.as_ref().expect("room was given");
        let at = self.written as usize;
        *crc = batchfs::crc::crc32c_append(*crc, &map[at..at + n]);
        self.written += n as u64;
    }

    fn append(&mut self, data: &[u8], crc: &mut u32) -> std::io::Result<()> {
        let room = self.spare(data.len())?;
        if room.len() < data.len() {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "the body runs past the manifest's size"));
        }
        room[..data.len()].copy_from_slice(data);
        self.commit(data.len(), crc);
        Ok(())
    }

    /// The file, unmapped, as long as what was written.
    pub fn finish(mut self) -> std::io::Result<std::fs::File> {
        drop(self.map.take());
        if self.file.metadata()?.len() != self.written {
            self.file.set_len(self.written)?;
        }
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

        /// Whatever the pieces' sizes, and whether they are appended or received into the room given,
        /// the file holds exactly the body, in order, with its CRC32C; past its size nothing is taken.
        #[test]
        fn a_memory_file_holds_its_pieces(
            pieces in proptest::collection::vec((0usize..(3 << 20), any::<bool>()), 0..8),
        ) {
            let len: usize = pieces.iter().map(|p| p.0).sum();
            let body: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let mut sink = Sink::File(MemoryFile::new(crate::sys::memfd("batchfs-test").unwrap(), len as u64).unwrap());
            let (mut at, mut crc) = (0, 0);
            for (n, direct) in pieces {
                let piece = &body[at..at + n];
                if direct {
                    let mut room = sink.spare(n).unwrap();
                    prop_assert_eq!(room.remaining(), n);
                    room.put_slice(piece);
                    sink.commit(n, &mut crc).unwrap();
                } else {
                    sink.append(piece, &mut crc).unwrap();
                }
                at += n;
                prop_assert_eq!(sink.len(), at as u64);
            }
            prop_assert_eq!(sink.spare(10).unwrap().remaining(), 0, "no room past the body");
            prop_assert!(sink.append(b"x", &mut crc.clone()).is_err());
            prop_assert_eq!(crc, crc32c::crc32c(&body));
            let Sink::File(m) = sink else { unreachable!() };
            let mut file = m.finish().unwrap();
            let mut all = Vec::new();
            std::io::Seek::rewind(&mut file).unwrap();
            file.read_to_end(&mut all).unwrap();
            prop_assert!(all == body, "the file is the body");
        }
    }

    #[test]
    fn a_memory_file_cut_short_is_as_long_as_what_was_written() {
        let mut m = MemoryFile::new(crate::sys::memfd("batchfs-test").unwrap(), 100).unwrap();
        m.append(&[1; 40], &mut 0).unwrap();
        assert_eq!(m.finish().unwrap().metadata().unwrap().len(), 40);
    }
}
