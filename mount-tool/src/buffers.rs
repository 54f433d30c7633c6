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
/// prefix readers may read, without a copy, before the rest has come ([`Partial`]), or a memory file (`memfd`) that the
/// kernel can later serve reads and mmap faults from by itself (FUSE passthrough), written chunk by chunk
/// with no buffer in between, and released only whole.
pub enum Sink {
    Buffer(Filling),
    File { file: std::fs::File, len: u64 },
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sink::Buffer(b) => write!(f, "Sink::Buffer({} bytes)", b.len()),
            Sink::File { len, .. } => write!(f, "Sink::File({len} bytes)"),
        }
    }
}

impl Sink {
    /// An empty memory file.
    pub fn memfd() -> std::io::Result<Self> {
        Ok(Sink::File { file: crate::sys::memfd("batchfs-batch")?, len: 0 })
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        match self {
            Sink::Buffer(b) => b.len(),
            Sink::File { len, .. } => *len,
        }
    }

    /// Whether nothing was written yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Offers the response's checkpoints (see [`Filling::expect_checkpoints`]); a memory file is
    /// released only whole and ignores them.
    pub fn expect_checkpoints(&mut self, checkpoints: Vec<(u64, u32)>) -> bool {
        match self {
            Sink::Buffer(b) => b.expect_checkpoints(checkpoints),
            Sink::File { .. } => false,
        }
    }

    /// Appends `data`, extending `crc` over it (and, into a buffer, checking the checkpoints reached:
    /// `InvalidData` when one does not match).
    pub fn append(&mut self, data: &[u8], crc: &mut u32) -> std::io::Result<()> {
        match self {
            Sink::Buffer(b) => b.append(data, crc)?,
            Sink::File { file, len } => {
                *crc = crc32c::crc32c_append(*crc, data);
                std::io::Write::write_all(file, data)?;
                *len += data.len() as u64;
            }
        }
        Ok(())
    }
}

/// A fetched body and the CRC32C of its bytes, computed as they arrived, while each piece was still
/// hot in the CPU cache (a second pass over a cold 7 MB body costs more).
#[derive(Debug)]
pub struct Body {
    pub sink: Sink,
    pub crc32c: u32,
}
