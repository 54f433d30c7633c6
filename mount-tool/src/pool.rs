//! Reused body buffers.
//!
//! Every batch body is several megabytes, above glibc's mmap threshold (fixed in [`crate::sys`] so
//! that freed bodies go back to the kernel and RSS stays within the cache budget). A fresh body buffer is
//! therefore a fresh mapping, and filling it takes a page fault, a zeroed page and a memory-cgroup
//! charge for every 4 KiB: perf put that at ~14 % of all CPU time in an unpaced epoch. The pool keeps
//! the buffers of evicted batches and hands them to the next fetches instead.
//!
//! Idle buffers are counted in the cache budget by the prefetcher (see
//! [`crate::prefetch::Prefetcher`]), which frees them before it evicts a cached batch, so the mount's
//! memory stays within `cache` as before.

use crate::sync::{Arc, AtomicU64, Mutex, Ordering};
use bytes::Bytes;

/// Buffers smaller than this are left to malloc: they come from its arenas, not fresh mappings.
pub const MIN_POOLED: usize = 256 << 10;

/// Idle body buffers, kept for reuse within the room the cache leaves.
pub struct BufferPool {
    inner: Mutex<Inner>,
    /// Sum of the idle buffers' capacities (also under the lock; readable without it).
    idle: AtomicU64,
}

struct Inner {
    free: Vec<Vec<u8>>,
    /// The budget minus what the cache holds: idle buffers never exceed it.
    room: u64,
}

/// The answer of [`BufferPool::admit`].
#[derive(Debug)]
pub enum Admission {
    /// The fetch fits: fill this buffer; `charge` bytes (its size or capacity, the larger) now count
    /// against the budget and have left the pool's room.
    Fits { buffer: Vec<u8>, charge: u64 },
    /// An idle buffer was freed to make room: ask again.
    Trimmed,
    /// The pool cannot make room: the cache must evict, or the fetch wait.
    Full,
}

impl BufferPool {
    /// An empty pool with `room` bytes of room.
    pub fn new(room: u64) -> Arc<Self> {
        Arc::new(BufferPool { inner: Mutex::new(Inner { free: Vec::new(), room }), idle: AtomicU64::new(0) })
    }

    /// Bytes held by idle buffers.
    pub fn idle_bytes(&self) -> u64 {
        self.idle.load(Ordering::Relaxed)
    }

    /// The buffer for `need` bytes: the smallest that holds them, else the largest (it grows).
    fn best(free: &[Vec<u8>], need: usize) -> Option<usize> {
        let fits = free.iter().enumerate().filter(|(_, b)| b.capacity() >= need).min_by_key(|(_, b)| b.capacity());
        fits.or_else(|| free.iter().enumerate().max_by_key(|(_, b)| b.capacity())).map(|(i, _)| i)
    }

    fn remove(&self, inner: &mut Inner, i: usize) -> Vec<u8> {
        let buf = inner.free.swap_remove(i);
        self.idle.fetch_sub(buf.capacity() as u64, Ordering::Relaxed);
        buf
    }

    /// Admits a fetch of `need` bytes when the cache leaves `room` bytes of the budget: it fits if,
    /// after taking the buffer it would reuse, the other idle buffers still fit beside it. Otherwise
    /// frees one idle buffer it would not reuse (or the one it would, when that is larger than needed).
    pub fn admit(&self, need: usize, room: u64) -> Admission {
        let mut inner = self.inner.lock().expect("pool");
        inner.room = room;
        let best = Self::best(&inner.free, need);
        let reuse = best.map_or(0, |i| inner.free[i].capacity() as u64);
        let charge = (need as u64).max(reuse);
        if charge + self.idle_bytes() - reuse <= room {
            let buffer = match best {
                Some(i) => {
                    let mut buf = self.remove(&mut inner, i);
                    buf.clear();
                    buf.reserve_exact(need);
                    buf
                }
                None => Vec::with_capacity(need),
            };
            // `charge` as predicted: a reused buffer only grows to exactly `need`.
            let charge = charge.max(buffer.capacity() as u64);
            inner.room = room.saturating_sub(charge);
            return Admission::Fits { buffer, charge };
        }
        let others = inner.free.iter().enumerate().filter(|(i, _)| Some(*i) != best);
        if let Some((i, _)) = others.max_by_key(|(_, b)| b.capacity()) {
            self.remove(&mut inner, i);
            return Admission::Trimmed;
        }
        match best {
            Some(i) if reuse > need as u64 => {
                // Larger than the body: a fresh buffer of the exact size may fit where this does not.
                self.remove(&mut inner, i);
                Admission::Trimmed
            }
            _ => Admission::Full,
        }
    }

    /// Sets the room the cache leaves (after it frees or charges bytes), freeing idle buffers beyond it.
    pub fn set_room(&self, room: u64) {
        let mut inner = self.inner.lock().expect("pool");
        inner.room = room;
        while self.idle_bytes() > room {
            let largest = inner.free.iter().enumerate().max_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
            self.remove(&mut inner, largest.expect("idle bytes without buffers"));
        }
    }

    /// `buf` as [`Bytes`] whose memory returns to the pool when the last clone or slice is dropped.
    pub fn wrap(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        if buf.capacity() < MIN_POOLED {
            return Bytes::from(buf);
        }
        Bytes::from_owner(Pooled { buf, pool: Arc::downgrade(self) })
    }

    /// Keeps `buf` if it fits in the room, else frees it.
    fn give(&self, buf: Vec<u8>) {
        let mut inner = self.inner.lock().expect("pool");
        let cap = buf.capacity() as u64;
        if self.idle_bytes() + cap <= inner.room {
            self.idle.fetch_add(cap, Ordering::Relaxed);
            inner.free.push(buf);
        }
    }
}

/// The owner behind a pooled [`Bytes`].
struct Pooled {
    buf: Vec<u8>,
    pool: std::sync::Weak<BufferPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: usize = 1 << 20;

    fn fits(a: Admission) -> (Vec<u8>, u64) {
        match a {
            Admission::Fits { buffer, charge } => (buffer, charge),
            other => panic!("expected a fit, got {other:?}"),
        }
    }

    #[test]
    fn buffers_come_back_when_the_last_slice_drops() {
        let pool = BufferPool::new(100 * MB as u64);
        let (mut buf, charge) = fits(pool.admit(2 * MB, 100 * MB as u64));
        assert_eq!(charge, 2 * MB as u64);
        buf.extend(std::iter::repeat_n(7u8, 2 * MB));
        let ptr = buf.as_ptr();
        let body = pool.wrap(buf);
        let slice = body.slice(10..20);
        drop(body);
        assert_eq!(pool.idle_bytes(), 0, "a slice still holds the buffer");
        assert_eq!(&slice[..], &[7u8; 10]);
        pool.set_room(100 * MB as u64); // the cache released the batch
        drop(slice);
        assert_eq!(pool.idle_bytes(), 2 * MB as u64);
        let (again, charge) = fits(pool.admit(MB, 100 * MB as u64));
        assert_eq!(again.as_ptr(), ptr, "the same memory is reused");
        assert!(again.is_empty());
        assert_eq!(charge, 2 * MB as u64, "the whole capacity is charged");
        assert_eq!(pool.idle_bytes(), 0);
    }

    fn pool_of(mbs: &[usize], room: u64) -> Arc<BufferPool> {
        let pool = BufferPool::new(room);
        for mb in mbs {
            pool.give(Vec::with_capacity(mb * MB));
        }
        pool
    }

    #[test]
    fn best_fit_then_largest() {
        let room = 100 * MB as u64;
        let (buf, charge) = fits(pool_of(&[3, 1, 5], room).admit(2 * MB, room));
        assert_eq!((buf.capacity(), charge), (3 * MB, 3 * MB as u64), "smallest that holds 2 MB");
        let pool = pool_of(&[3, 1, 5], room);
        let (buf, charge) = fits(pool.admit(9 * MB, room));
        assert_eq!((buf.capacity(), charge), (9 * MB, 9 * MB as u64), "none holds 9 MB: the largest grows");
        assert_eq!(pool.idle_bytes(), 4 * MB as u64);
    }

    #[test]
    fn room_bounds_the_idle_buffers() {
        let room = 10 * MB as u64;
        let pool = pool_of(&[2, 4, 8], room);
        assert_eq!(pool.idle_bytes(), 6 * MB as u64, "the 8 MB buffer did not fit beside the others");
        // 3 MB with 6 MB idle in 8 MB of room: reusing the 4 MB buffer leaves 2 MB idle, 4 + 2 <= 8.
        let (buf, charge) = fits(pool.admit(3 * MB, 8 * MB as u64));
        assert_eq!((buf.capacity(), charge), (4 * MB, 4 * MB as u64));
        drop(buf);
        // A smaller buffer grows to exactly the size needed.
        let (buf, charge) = fits(pool_of(&[2], room).admit(3 * MB, 4 * MB as u64));
        assert_eq!((buf.capacity(), charge), (3 * MB, 3 * MB as u64));
        // 3 MB in 4 MB of room with 2 and 5 MB idle: the 2 MB one goes first, then the 5 MB one is too
        // large for the room, and a fresh 3 MB buffer fits.
        let pool = pool_of(&[2, 5], room);
        assert!(matches!(pool.admit(3 * MB, 4 * MB as u64), Admission::Trimmed));
        assert_eq!(pool.idle_bytes(), 5 * MB as u64);
        assert!(matches!(pool.admit(3 * MB, 4 * MB as u64), Admission::Trimmed));
        assert_eq!(fits(pool.admit(3 * MB, 4 * MB as u64)).1, 3 * MB as u64);
        // Only a buffer larger than needed is left and the room is short: it is freed for a fresh one.
        let pool = pool_of(&[5], room);
        assert!(matches!(pool.admit(3 * MB, 4 * MB as u64), Admission::Trimmed));
        assert!(matches!(pool.admit(5 * MB, 4 * MB as u64), Admission::Full));
        // Less room frees the largest idle buffers.
        let pool = pool_of(&[1, 2, 3], room);
        pool.set_room(4 * MB as u64);
        assert_eq!(pool.idle_bytes(), 3 * MB as u64);
    }

    #[test]
    fn small_buffers_and_a_dropped_pool_are_not_pooled() {
        let pool = BufferPool::new(100 * MB as u64);
        drop(pool.wrap(vec![1u8; 1000]));
        assert_eq!(pool.idle_bytes(), 0);
        let body = pool.wrap(vec![1u8; MIN_POOLED]);
        drop(pool);
        drop(body); // the pool is gone: the memory is simply freed
    }
}
