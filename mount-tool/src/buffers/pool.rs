//! The cache's byte budget, one ledger, and the body buffers reused within it.
//!
//! Every batch body is several megabytes, above glibc's mmap threshold (fixed in [`crate::sys`] so
//! that freed bodies go back to the kernel and RSS stays within the cache budget). A fresh body buffer is
//! therefore a fresh mapping, and filling it takes a page fault, a zeroed page and a memory-cgroup
//! charge for every 4 KiB: perf put that at ~14 % of all CPU time in an unpaced epoch. The pool keeps
//! the buffers of evicted batches and hands them to the next fetches instead.
//!
//! **One ledger.** The pool holds the budget: the bytes charged to cached bodies and fetches in flight
//! (`used`, charged by [`BufferPool::admit`], released by [`BufferPool::release`]) and the idle buffers
//! kept for reuse, always with `used + idle <= total`. Idle buffers go first: an admission frees them
//! before the prefetcher has to evict a cached batch, so the mount's memory stays within `cache`.
//!
//! **Memory files come back too.** A memory file of the huge-page tmpfs that the cache lent out
//! ([`BufferPool::lend`]) returns once the daemon no longer holds it (no cache entry, no open file, no
//! mapping of its own) and is idle from then on, counted like an idle buffer. The next fetch into a
//! memory file takes it ([`Admission::Fits`]'s `file`) once [`crate::sys::unshared`] says no loader has it
//! open or mapped any more, and receives the body straight into its pages, which are already there: one
//! copy, where a fresh file costs a copy through a buffer (or pages the kernel zeroes first).

use crate::sync::{Arc, AtomicBool, AtomicU64, Mutex, Ordering};
use batchfs::mmap::MappedFile;
use std::fs::File;
use std::sync::Weak;

/// Buffers smaller than this are left to malloc: they come from its arenas, not fresh mappings.
pub const MIN_POOLED: usize = 256 << 10;

/// Memory files smaller than this are not lent and come back to no one: a huge page (2 MiB) at least,
/// where receiving in place pays for the bookkeeping.
pub const MIN_RECYCLED: u64 = crate::buffers::WRITE_SPAN;

/// The byte budget and the idle body buffers kept for reuse within it.
pub struct BufferPool {
    total: u64,
    inner: Mutex<Inner>,
    /// Sum of the idle buffers' capacities (also under the lock; readable without it).
    idle: AtomicU64,
    /// Bytes charged (also under the lock; readable without it).
    used: AtomicU64,
    /// Memory files are taken back (cleared for good where the kernel grants no leases).
    recycling: AtomicBool,
}

struct Inner {
    free: Vec<Vec<u8>>,
    used: u64,
    /// Memory files lent to the cache: each comes back once only this list holds it.
    lent: Vec<Lent>,
    /// Idle memory files (read-only descriptors, this pool's alone) and their sizes, in `idle`.
    files: Vec<(File, u64)>,
}

/// A memory file lent to the cache (the pool's own descriptor of it, a `dup` of the cache's: one open
/// file), the cache's handle on it (held by its entry and open files) and the daemon's mapping of it (a
/// body read through the daemon).
struct Lent {
    file: File,
    user: Weak<File>,
    mapping: Weak<MappedFile>,
    len: u64,
}

/// The answer of [`BufferPool::admit`].
#[derive(Debug)]
pub enum Admission {
    /// The fetch fits: fill this buffer; `charge` bytes (its size or capacity, the larger) are now
    /// charged, until [`BufferPool::release`]. For a memory file ([`BufferPool::charge`]), `file` may be
    /// an idle one that no one else holds, to fill again (its read-only descriptor).
    Fits { buffer: Vec<u8>, charge: u64, file: Option<File> },
    /// An idle buffer was freed to make room: ask again.
    Trimmed,
    /// Only releasing charged bytes can make room: the cache must evict, or the fetch wait.
    Full,
}

impl BufferPool {
    /// An empty pool with a budget of `total` bytes, none charged.
    pub fn new(total: u64) -> Arc<Self> {
        Arc::new(BufferPool {
            total,
            inner: Mutex::new(Inner { free: Vec::new(), used: 0, lent: Vec::new(), files: Vec::new() }),
            idle: AtomicU64::new(0),
            used: AtomicU64::new(0),
            recycling: AtomicBool::new(true),
        })
    }

    /// Bytes held by idle buffers.
    pub fn idle_bytes(&self) -> u64 {
        self.idle.load(Ordering::Relaxed)
    }

    /// Bytes charged to cached bodies and fetches in flight.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Bytes charged and idle together, read at one instant (never above the budget).
    pub fn held(&self) -> u64 {
        let inner = self.inner.lock().expect("pool");
        inner.used + self.idle_bytes()
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

    fn set_used(&self, inner: &mut Inner, used: u64) {
        inner.used = used;
        self.used.store(used, Ordering::Relaxed);
    }

    /// Admits a fetch of `need` bytes: it fits if, after taking the buffer it would reuse, its charge
    /// and the other idle buffers fit in what is not charged. Otherwise frees one idle buffer it would not
    /// reuse (or the one it would, when that is larger than needed).
    pub fn admit(&self, need: usize) -> Admission {
        self.admit_with(need, true)
    }

    /// Admits a fetch of `need` bytes that brings its own memory (a memory file): charged like
    /// [`BufferPool::admit`], but no idle buffer is taken, and none allocated (`buffer` is empty).
    pub fn charge(&self, need: usize) -> Admission {
        self.admit_with(need, false)
    }

    fn admit_with(&self, need: usize, buffered: bool) -> Admission {
        let mut inner = self.inner.lock().expect("pool");
        self.take_back(&mut inner);
        let room = self.total.saturating_sub(inner.used);
        let best = if buffered { Self::best(&inner.free, need) } else { None };
        let file = if buffered { None } else { self.reusable(&inner, need as u64) };
        let reuse = best.map_or(0, |i| inner.free[i].capacity() as u64) + file.map_or(0, |i| inner.files[i].1);
        // A file is cut or grown to exactly `need`; a buffer keeps its capacity.
        let charge = if file.is_some() { need as u64 } else { (need as u64).max(reuse) };
        if charge + self.idle_bytes() - reuse <= room {
            let buffer = match best {
                Some(i) => {
                    let mut buf = self.remove(&mut inner, i);
                    buf.clear();
                    buf.reserve_exact(need);
                    buf
                }
                None if buffered => crate::sys::huge_buffer(need),
                None => Vec::new(),
            };
            let file = file.map(|i| self.remove_file(&mut inner, i));
            // `charge` as predicted: a reused buffer only grows to exactly `need`.
            let charge = charge.max(buffer.capacity() as u64);
            debug_assert!(buffered || buffer.capacity() == 0);
            let used = inner.used + charge;
            self.set_used(&mut inner, used);
            return Admission::Fits { buffer, charge, file };
        }
        let others = inner.free.iter().enumerate().filter(|(i, _)| Some(*i) != best);
        if let Some((i, _)) = others.max_by_key(|(_, b)| b.capacity()) {
            self.remove(&mut inner, i);
            return Admission::Trimmed;
        }
        let other_files = inner.files.iter().enumerate().filter(|(i, _)| Some(*i) != file);
        if let Some((i, _)) = other_files.max_by_key(|(_, (_, len))| *len) {
            self.remove_file(&mut inner, i);
            return Admission::Trimmed;
        }
        match best {
            Some(i) if reuse > need as u64 => {
                // Larger than the body: a fresh buffer of the exact size may fit where this does not.
                self.remove(&mut inner, i);
                Admission::Trimmed
            }
            // An idle file to fill again is kept: evicting a batch makes room for it (and gives another
            // file to choose from), where freeing it would make the fetch a fresh file's, two copies.
            // With nothing to evict, the cache frees it ([`BufferPool::trim_file`]).
            _ => Admission::Full,
        }
    }

    /// Whether a fetch of `need` bytes into a memory file may get one filled again: memory files are on
    /// the huge-page tmpfs, the kernel has granted leases so far, and the body is large enough.
    pub fn recycles(&self, need: u64) -> bool {
        need >= MIN_RECYCLED && crate::sys::huge_pages() && self.recycling.load(Ordering::Relaxed)
    }

    /// Frees the largest idle memory file, if there is one (before a read waits for room, for want of a
    /// batch to evict): whether one was freed.
    pub fn trim_file(&self) -> bool {
        let mut inner = self.inner.lock().expect("pool");
        let largest = inner.files.iter().enumerate().max_by_key(|(_, (_, len))| *len).map(|(i, _)| i);
        largest.map(|i| self.remove_file(&mut inner, i)).is_some()
    }

    /// Lends the cache a memory file of `len` bytes (sealed, read-only) and the daemon's mapping of it:
    /// it comes back idle once neither is held anywhere else in the daemon. Only files of the huge-page
    /// tmpfs, which can be written again (a sealed memfd cannot), of at least [`MIN_RECYCLED`] bytes.
    pub fn lend(&self, file: &Arc<File>, mapping: Weak<MappedFile>, len: u64) {
        if !self.recycles(len) {
            return;
        }
        let Ok(own) = file.try_clone() else { return };
        let lent = Lent { file: own, user: Arc::downgrade(file), mapping, len };
        self.inner.lock().expect("pool").lent.push(lent);
    }

    /// Brings back the lent files the daemon no longer holds (at every admission, so that none outlives
    /// its batch uncounted): idle if they fit beside what is charged and idle, else closed (their memory
    /// freed once no loader maps them).
    fn take_back(&self, inner: &mut Inner) {
        let mut i = 0;
        while i < inner.lent.len() {
            let l = &inner.lent[i];
            if l.user.strong_count() > 0 || l.mapping.strong_count() > 0 {
                i += 1;
                continue;
            }
            let l = inner.lent.swap_remove(i);
            if inner.used + self.idle_bytes() + l.len <= self.total {
                self.idle.fetch_add(l.len, Ordering::Relaxed);
                inner.files.push((l.file, l.len));
            }
        }
    }

    /// The idle file to fill with `need` bytes: the smallest that holds them of those no one else has
    /// open or mapped (asked of the kernel, a few at most). None smaller: a file grown has its new pages
    /// zeroed by the kernel before the body overwrites them, which measured no cheaper than a fresh
    /// file's two copies.
    fn reusable(&self, inner: &Inner, need: u64) -> Option<usize> {
        if need < MIN_RECYCLED {
            return None;
        }
        let mut order: Vec<usize> = (0..inner.files.len()).filter(|&i| inner.files[i].1 >= need).collect();
        order.sort_by_key(|&i| inner.files[i].1);
        for i in order.into_iter().take(4) {
            match crate::sys::unshared(&inner.files[i].0) {
                Ok(true) => return Some(i),
                Ok(false) => {}
                Err(e) => {
                    tracing::info!(error = %e, "memory files are not filled again: the kernel grants no lease");
                    self.recycling.store(false, Ordering::Relaxed);
                    return None;
                }
            }
        }
        None
    }

    fn remove_file(&self, inner: &mut Inner, i: usize) -> File {
        let (file, len) = inner.files.swap_remove(i);
        self.idle.fetch_sub(len, Ordering::Relaxed);
        file
    }

    /// Returns `bytes` charged by an admission (an evicted batch, a failed fetch).
    pub fn release(&self, bytes: u64) {
        let mut inner = self.inner.lock().expect("pool");
        let used = inner.used.checked_sub(bytes).expect("released more than was charged");
        self.set_used(&mut inner, used);
    }

    /// Takes back the buffer of a body no longer used, once its last view is dropped (kept for reuse if
    /// large enough and it fits; see [`crate::buffers::Partial`], the owner of a body's buffer).
    pub fn recycle(&self, buf: Vec<u8>) {
        if buf.capacity() >= MIN_POOLED {
            self.give(buf);
        }
    }

    /// Keeps `buf` if it fits beside what is charged and idle, else frees it.
    fn give(&self, buf: Vec<u8>) {
        let mut inner = self.inner.lock().expect("pool");
        let cap = buf.capacity() as u64;
        if inner.used + self.idle_bytes() + cap <= self.total {
            self.idle.fetch_add(cap, Ordering::Relaxed);
            inner.free.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffers::Filling;
    use bytes::Bytes;

    const MB: usize = 1 << 20;

    fn fits(a: Admission) -> (Vec<u8>, u64) {
        match a {
            Admission::Fits { buffer, charge, .. } => (buffer, charge),
            other => panic!("expected a fit, got {other:?}"),
        }
    }

    /// `buf` filled with `len` sevens as a verified body whose buffer returns to `pool`.
    fn body_in(pool: &Arc<BufferPool>, buf: Vec<u8>, len: usize) -> Bytes {
        let bytes = vec![7u8; len];
        let mut filling = Filling::new(buf, (len as u64, crc32c::crc32c(&bytes)), Some(Arc::downgrade(pool)), || {});
        filling.append(&bytes, &mut 0).unwrap();
        filling.finish()
    }

    #[test]
    fn buffers_come_back_when_the_last_slice_drops() {
        let pool = BufferPool::new(100 * MB as u64);
        let (buf, charge) = fits(pool.admit(2 * MB));
        assert_eq!((charge, pool.used()), (2 * MB as u64, 2 * MB as u64));
        let ptr = buf.as_ptr();
        let body = body_in(&pool, buf, 2 * MB);
        assert_eq!(body.as_ptr(), ptr, "the body is the buffer, not a copy");
        let slice = body.slice(10..20);
        drop(body);
        assert_eq!(pool.idle_bytes(), 0, "a slice still holds the buffer");
        assert_eq!(&slice[..], &[7u8; 10]);
        pool.release(charge); // the cache evicted the batch
        drop(slice);
        assert_eq!((pool.idle_bytes(), pool.used()), (2 * MB as u64, 0));
        let (again, charge) = fits(pool.admit(MB));
        assert_eq!(again.as_ptr(), ptr, "the same memory is reused");
        assert!(again.is_empty());
        assert_eq!(charge, 2 * MB as u64, "the whole capacity is charged");
        assert_eq!((pool.idle_bytes(), pool.used()), (0, 2 * MB as u64));
    }

    /// A pool of `total` bytes with `charged` bytes charged and idle buffers of `mbs` MB (those that fit).
    fn pool_of(mbs: &[usize], total: u64, charged: u64) -> Arc<BufferPool> {
        let pool = BufferPool::new(total);
        pool.set_used(&mut pool.inner.lock().unwrap(), charged);
        for mb in mbs {
            pool.give(Vec::with_capacity(mb * MB));
        }
        pool
    }

    #[test]
    fn best_fit_then_largest() {
        let total = 100 * MB as u64;
        let (buf, charge) = fits(pool_of(&[3, 1, 5], total, 0).admit(2 * MB));
        assert_eq!((buf.capacity(), charge), (3 * MB, 3 * MB as u64), "smallest that holds 2 MB");
        let pool = pool_of(&[3, 1, 5], total, 0);
        let (buf, charge) = fits(pool.admit(9 * MB));
        assert_eq!((buf.capacity(), charge), (9 * MB, 9 * MB as u64), "none holds 9 MB: the largest grows");
        assert_eq!(pool.idle_bytes(), 4 * MB as u64);
    }

    #[test]
    fn the_budget_bounds_charged_and_idle_bytes_together() {
        let pool = pool_of(&[2, 4, 8], 10 * MB as u64, 0);
        assert_eq!(pool.idle_bytes(), 6 * MB as u64, "the 8 MB buffer did not fit beside the others");
        // 3 MB with 6 MB idle and 8 MB free: reusing the 4 MB buffer leaves 2 MB idle, 4 + 2 <= 8.
        let pool = pool_of(&[2, 4], 10 * MB as u64, 2 * MB as u64);
        let (buf, charge) = fits(pool.admit(3 * MB));
        assert_eq!((buf.capacity(), charge), (4 * MB, 4 * MB as u64));
        assert_eq!(pool.used() + pool.idle_bytes(), 8 * MB as u64);
        drop(buf);
        // A smaller buffer grows to exactly the size needed.
        let (buf, charge) = fits(pool_of(&[2], 4 * MB as u64, 0).admit(3 * MB));
        assert_eq!((buf.capacity(), charge), (3 * MB, 3 * MB as u64));
        // 3 MB with 4 MB free, two 2 MB buffers idle: one is freed, the other grows.
        let pool = pool_of(&[2, 2], 6 * MB as u64, 2 * MB as u64);
        assert!(matches!(pool.admit(3 * MB), Admission::Trimmed), "one 2 MB buffer goes");
        assert_eq!(pool.idle_bytes(), 2 * MB as u64);
        let (buf, charge) = fits(pool.admit(3 * MB));
        assert_eq!((buf.capacity(), charge), (3 * MB, 3 * MB as u64), "the other grows");
        assert_eq!((pool.used(), pool.idle_bytes()), (5 * MB as u64, 0));
        // Nothing idle and too little free: only releasing charged bytes (an eviction) makes room.
        let pool = pool_of(&[], 9 * MB as u64, 4 * MB as u64);
        assert!(matches!(pool.admit(6 * MB), Admission::Full));
        pool.release(4 * MB as u64);
        assert_eq!(fits(pool.admit(6 * MB)).1, 6 * MB as u64);
        // Idle buffers never take the room of charged bytes: a returned buffer that does not fit is freed.
        let pool = pool_of(&[], 9 * MB as u64, 6 * MB as u64);
        pool.give(Vec::with_capacity(4 * MB));
        assert_eq!(pool.idle_bytes(), 0);
    }

    #[test]
    fn memory_files_are_charged_without_buffers() {
        // Idle buffers still count: they are freed to make room, never handed out.
        let pool = pool_of(&[2, 2], 6 * MB as u64, 0);
        let (buf, charge) = fits(pool.charge(2 * MB));
        assert_eq!((buf.capacity(), charge, pool.idle_bytes()), (0, 2 * MB as u64, 4 * MB as u64));
        assert!(matches!(pool.charge(2 * MB), Admission::Trimmed));
        let (buf, charge) = fits(pool.charge(2 * MB));
        assert_eq!((buf.capacity(), charge, pool.held()), (0, 2 * MB as u64, 6 * MB as u64));
        assert!(matches!(pool.charge(MB), Admission::Trimmed), "the last idle buffer goes");
        assert_eq!(fits(pool.charge(MB)).1, MB as u64);
        assert!(matches!(pool.charge(2 * MB), Admission::Full), "only an eviction makes room now");
    }

    /// A sealed memory file of `mb` MB on the huge-page tmpfs, lent to `pool` with a mapping of its own;
    /// the cache's handle and the mapping returned (`None` where that tmpfs is not to be had: not root).
    fn lent(pool: &BufferPool, mb: usize) -> Option<(Arc<File>, Arc<MappedFile>)> {
        crate::sys::use_huge_pages().ok()?;
        let f = crate::sys::memory_file("batchfs-test", (mb * MB) as u64).unwrap();
        std::io::Write::write_all(&mut &f, &vec![mb as u8; mb * MB]).unwrap();
        let f = Arc::new(crate::sys::seal(f).unwrap());
        let map = Arc::new(MappedFile::open_file(&f).unwrap());
        pool.lend(&f, Arc::downgrade(&map), (mb * MB) as u64);
        Some((f, map))
    }

    fn file_of(a: Admission) -> Option<File> {
        match a {
            Admission::Fits { file, .. } => file,
            other => panic!("expected a fit, got {other:?}"),
        }
    }

    /// A lent memory file comes back idle (counted) only once the cache's handle and the daemon's
    /// mapping are gone, is handed to a fetch into a memory file (never to a buffer's) only while no one
    /// else has it open or mapped, and is closed, like an idle buffer, when its room is wanted.
    #[test]
    fn memory_files_come_back_idle_and_are_filled_again_only_when_no_one_holds_them() {
        let pool = BufferPool::new(100 * MB as u64);
        let Some((f, map)) = lent(&pool, 4) else { return };
        assert!(file_of(pool.charge(3 * MB)).is_none(), "the cache still holds it");
        let loader = crate::sys::reopen(&f, false).unwrap();
        drop(f);
        assert!(file_of(pool.charge(3 * MB)).is_none(), "the daemon still maps it");
        drop(map);
        assert!(file_of(pool.charge(3 * MB)).is_none(), "a loader has it open");
        assert_eq!(pool.idle_bytes(), 4 * MB as u64, "idle all the same, and counted");
        assert!(fits(pool.admit(3 * MB)).0.capacity() >= 3 * MB, "a buffer is not a file");
        drop(loader);
        let used = pool.used();
        let file = file_of(pool.charge(3 * MB)).expect("filled again");
        assert_eq!(file.metadata().unwrap().len(), 4 * MB as u64, "the file lent");
        assert_eq!((pool.idle_bytes(), pool.used() - used), (0, 3 * MB as u64), "charged as the body's size");
        // An idle file goes when its room is wanted, as an idle buffer does; one smaller than the body is
        // not grown (the kernel would zero the new pages first).
        let pool = BufferPool::new(10 * MB as u64);
        let Some((f, map)) = lent(&pool, 4) else { return };
        drop((f, map));
        assert!(file_of(pool.charge(MB)).is_none(), "smaller than a huge page: not filled again");
        assert_eq!(pool.idle_bytes(), 4 * MB as u64, "taken back all the same: no file outlives its batch uncounted");
        fits(pool.admit(4 * MB));
        assert!(matches!(pool.charge(6 * MB), Admission::Trimmed), "smaller than the body: freed for room");
        assert_eq!(pool.idle_bytes(), 0);
        // One a loader still has stays idle; with nothing to evict, the cache frees it for a read.
        let pool = BufferPool::new(100 * MB as u64);
        let Some((f, map)) = lent(&pool, 4) else { return };
        let loader = crate::sys::reopen(&f, false).unwrap();
        drop((f, map));
        assert!(file_of(pool.charge(2 * MB)).is_none(), "a loader has it open");
        assert_eq!(pool.idle_bytes(), 4 * MB as u64);
        assert!(pool.trim_file());
        assert_eq!(pool.idle_bytes(), 0);
        assert!(!pool.trim_file());
        drop(loader);
    }

    #[test]
    fn small_buffers_and_a_dropped_pool_are_not_pooled() {
        let pool = BufferPool::new(100 * MB as u64);
        drop(body_in(&pool, Vec::new(), 1000));
        assert_eq!(pool.idle_bytes(), 0);
        let body = body_in(&pool, Vec::new(), MIN_POOLED);
        drop(pool);
        drop(body); // the pool is gone: the memory is simply freed
    }
}
