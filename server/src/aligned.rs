//! Buffers for direct I/O (`O_DIRECT`): each read's destination starts on a [`DIRECT_ALIGN`] boundary,
//! and buffers are reused, so a read neither zeroes nor faults in fresh memory.
//!
//! A [`Pool`] hands out [`Buffer`]s of one capacity. A filled buffer becomes a shared, read-only
//! [`bytes::Bytes`] whose slices are the body's frames; when the last frame is sent (dropped), the buffer
//! goes back to the pool. The pool keeps at most `max_idle` idle buffers and frees the rest, so what it
//! holds is bounded by what the bodies in flight hold plus `max_idle × capacity`.

use std::sync::{Arc, Mutex};

/// Alignment of a direct read's file offset, length and destination. 4 KiB satisfies every Linux block
/// device's logical block size (512 B or 4 KiB) and the page alignment some filesystems ask of memory.
pub const DIRECT_ALIGN: u64 = 4096;

/// `x` rounded down to the alignment.
pub fn align_down(x: u64) -> u64 {
    x / DIRECT_ALIGN * DIRECT_ALIGN
}

/// `x` rounded up to the alignment.
pub fn align_up(x: u64) -> u64 {
    x.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN
}

/// Reusable aligned buffers of one capacity.
pub struct Pool {
    capacity: usize,
    max_idle: usize,
    idle: Mutex<Vec<Vec<u8>>>,
}

impl Pool {
    /// Buffers of `capacity` bytes (rounded up to the alignment), keeping at most `max_idle` idle.
    pub fn new(capacity: usize, max_idle: usize) -> Arc<Pool> {
        let capacity = align_up(capacity as u64) as usize;
        Arc::new(Pool { capacity, max_idle, idle: Mutex::new(Vec::new()) })
    }

    /// Usable bytes per buffer.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// An idle buffer, or a new one.
    pub fn take(self: &Arc<Self>) -> Buffer {
        let reused = self.idle.lock().expect("pool").pop();
        // One alignment's slack lets the aligned window sit anywhere in the allocation; a new buffer is
        // zeroed by the allocator (fresh pages: nothing is written until a read fills them).
        let vec = reused.unwrap_or_else(|| vec![0u8; self.capacity + DIRECT_ALIGN as usize]);
        let misalign = vec.as_ptr() as usize % DIRECT_ALIGN as usize;
        let start = (DIRECT_ALIGN as usize - misalign) % DIRECT_ALIGN as usize;
        Buffer { vec, start, len: 0, pool: self.clone() }
    }

    /// Idle buffers held now.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.idle.lock().expect("pool").len()
    }

    fn give_back(&self, vec: Vec<u8>) {
        let mut idle = self.idle.lock().expect("pool");
        if idle.len() < self.max_idle {
            idle.push(vec);
        }
    }
}

/// An aligned buffer from a [`Pool`]: `capacity` writable bytes starting on an aligned address, of which
/// the first `len` are filled. Dropped, it goes back to its pool.
pub struct Buffer {
    vec: Vec<u8>,
    start: usize,
    len: usize,
    pool: Arc<Pool>,
}

impl Buffer {
    /// The whole aligned window, to read into.
    pub fn window(&mut self) -> &mut [u8] {
        let end = self.start + self.pool.capacity;
        &mut self.vec[self.start..end]
    }

    /// Marks the first `len` bytes of the window filled.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.pool.capacity, "past the buffer");
        self.len = len;
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        &self.vec[self.start..self.start + self.len]
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.vec));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_reused_and_bounded() {
        let pool = Pool::new(10_000, 2);
        assert_eq!(pool.capacity(), 12_288);
        let mut bufs: Vec<Buffer> = (0..3).map(|_| pool.take()).collect();
        for b in &mut bufs {
            let w = b.window();
            assert_eq!(w.as_ptr() as usize % DIRECT_ALIGN as usize, 0);
            assert_eq!(w.len(), 12_288);
            w[..3].copy_from_slice(b"abc");
            b.set_len(3);
            assert_eq!(b.as_ref(), b"abc");
        }
        let first = bufs[0].vec.as_ptr();
        // Shared as Bytes, a buffer returns only when its last slice is gone.
        let shared = bytes::Bytes::from_owner(bufs.remove(0));
        let slice = shared.slice(1..3);
        drop(shared);
        assert_eq!((&slice[..], pool.idle()), (&b"bc"[..], 0));
        drop(slice);
        assert_eq!(pool.idle(), 1);
        drop(bufs);
        assert_eq!(pool.idle(), 2, "at most max_idle are kept");
        let again = pool.take();
        assert!(again.vec.as_ptr() == first || pool.idle() == 1);
        assert_eq!((align_down(4097), align_up(4097), align_up(0)), (4096, 8192, 0));
    }
}
