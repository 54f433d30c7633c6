//! Direct reads through one io_uring per server, its completions reaped by the runtime.
//!
//! A chunk of a shuffled batch is a handful of ranges in different places of different shards. Read one
//! `pread` after another, each sleeps until the device answers: a context switch and a device
//! notification per range. Submitted together through a ring, the ranges go to the device in one call
//! and are read in parallel. And no thread need sleep for them at all: the tokio worker that plans a
//! chunk submits its reads (a system call that does not wait), the ring signals an eventfd as reads
//! complete, and a driver task on the runtime, woken by that eventfd like by any socket, reaps the
//! completions and wakes the chunks whose reads are all done. An earlier version slept a blocking-pool
//! thread in `io_uring_enter` per chunk: on a 2-core virtual machine, 18 % of the server's CPU went to
//! those switches (docs/BENCHMARKS.md, "Where the direct server's CPU goes").
//!
//! **The buffers belong to the ring while it reads into them.** A chunk hands its buffer over with its
//! reads and gets it back when the last one completes. A chunk dropped meanwhile (its body cancelled)
//! drops only its receiver: the buffer goes back to the pool when its reads have completed, never
//! before. Reads the ring can no longer account for (it failed, or it is dropped with reads in flight)
//! leak their buffers: the kernel may still write into them.
//!
//! **So do the files.** A read names its file by descriptor number only, and a busy kernel (`EAGAIN`,
//! `EBUSY`) leaves reads queued, unsubmitted, for the driver to submit later: what keeps the descriptors
//! open (a copy in the disk tier opened for the chunk, the storage of a direct shard) is handed to the
//! ring with the reads ([`Keep`]) and let go with the buffer, never with a dropped chunk. Before, a body
//! dropped meanwhile could close the last handle of an evicted copy, and the queued read then read
//! whatever took its number (another copy, a client's socket).
//!
//! Where the kernel refuses io_uring (too old, disabled by `kernel.io_uring_disabled` or a seccomp
//! profile), [`Ring::new`] fails and the caller reads with `pread` on the blocking pool.

use crate::aligned::Buffer;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

/// Submission queue entries, and so reads in flight at once on the ring (the completion queue holds
/// twice as many, so it never overflows). A chunk with more reads is read in rounds.
const ENTRIES: u32 = 256;

/// Bits of a completion's `user_data` that number a read within its submission; the rest number the
/// submission.
const OP_BITS: u32 = 16;

/// What keeps the descriptors of a submission's reads open: held by the ring until its last read
/// completes.
pub type Keep = Arc<dyn std::any::Any + Send + Sync>;

/// One read: `len` bytes of `fd` at `offset`, into the buffer's window at `at`.
#[derive(Debug, Clone, Copy)]
pub struct ReadOp {
    pub fd: RawFd,
    pub offset: u64,
    pub at: usize,
    pub len: usize,
}

/// A server's ring. Made in a runtime, whose driver task reaps it.
pub struct Ring {
    state: Mutex<State>,
    /// Reads in flight (or queued) on the ring: at most [`ENTRIES`].
    slots: Arc<Semaphore>,
    /// Set when the kernel refused a submission: reads queued since may never complete, and later chunks
    /// are read with `pread`.
    failed: AtomicBool,
    /// Submissions made.
    submitted: AtomicU64,
    /// Dropped with the ring, which stops its driver.
    _stop: oneshot::Sender<()>,
}

struct State {
    ring: io_uring::IoUring,
    reads: HashMap<u64, InFlight>,
    next: u64,
}

/// One submission's reads, and the buffer they land in, until the last completes.
struct InFlight {
    buffer: Option<Buffer>,
    results: Vec<i32>,
    left: usize,
    done: Option<oneshot::Sender<(Buffer, Vec<i32>)>>,
    _slots: OwnedSemaphorePermit,
    /// The reads' files, open until the last completes (or for ever, like the buffer, where it never does).
    keep: Option<Keep>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.left > 0 {
            // The kernel may still write into the buffer: it must never be reused or freed.
            std::mem::forget(self.buffer.take());
            // Nor may its descriptors be closed, and their numbers reused, under reads the kernel may
            // still submit.
            std::mem::forget(self.keep.take());
        }
    }
}

impl Ring {
    /// A ring and its driver task on the current runtime. Fails where the kernel refuses io_uring.
    pub fn new() -> std::io::Result<Arc<Ring>> {
        let ring = io_uring::IoUring::new(ENTRIES)?;
        // SAFETY: eventfd(2) with valid flags; a non-negative result is a new descriptor we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor owned by nothing else.
        let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
        ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
        // SAFETY: the descriptor is open and stays open and the same file while the `AsyncFd` owns it.
        let eventfd =
            unsafe { AsyncFd::register_with_interest(eventfd, Interest::READABLE) }.map_err(|e| e.into_parts().1)?;
        let (stop, stopped) = oneshot::channel();
        let ring = Arc::new(Ring {
            state: Mutex::new(State { ring, reads: HashMap::new(), next: 0 }),
            slots: Arc::new(Semaphore::new(ENTRIES as usize)),
            failed: AtomicBool::new(false),
            submitted: AtomicU64::new(0),
            _stop: stop,
        });
        tokio::spawn(drive(Arc::downgrade(&ring), eventfd, stopped));
        Ok(ring)
    }

    /// Reads every op into `buffer`'s window and returns the buffer with each op's result (bytes read,
    /// which may be short at a file's end, or the error), in order. `keep` holds the ops' descriptors
    /// open: the ring keeps it until their reads complete, even where this future is dropped first.
    pub async fn read(
        &self,
        mut buffer: Buffer,
        ops: &[ReadOp],
        keep: Keep,
    ) -> std::io::Result<(Buffer, Vec<std::io::Result<usize>>)> {
        let room = buffer.window().len();
        for op in ops {
            assert!(op.at + op.len <= room && op.len <= u32::MAX as usize, "a read past the window");
        }
        let mut results = Vec::with_capacity(ops.len());
        for round in ops.chunks(ENTRIES as usize) {
            let slots =
                self.slots.clone().acquire_many_owned(round.len() as u32).await.map_err(std::io::Error::other)?;
            let done = self.submit(buffer, round, slots, keep.clone())?;
            let (back, got) = done.await.map_err(|_| std::io::Error::other("io_uring stopped with reads in flight"))?;
            buffer = back;
            results.extend(got.into_iter().map(|r| {
                if r < 0 {
                    Err(std::io::Error::from_raw_os_error(-r))
                } else {
                    Ok(r as usize)
                }
            }));
        }
        Ok((buffer, results))
    }

    /// Queues `ops` (at most the slots held) into `buffer` and submits them.
    fn submit(
        &self,
        mut buffer: Buffer,
        ops: &[ReadOp],
        slots: OwnedSemaphorePermit,
        keep: Keep,
    ) -> std::io::Result<oneshot::Receiver<(Buffer, Vec<i32>)>> {
        if self.failed.load(Ordering::Relaxed) {
            return Err(std::io::Error::other("io_uring refused an earlier submission"));
        }
        self.submitted.fetch_add(1, Ordering::Relaxed);
        let base = buffer.window().as_mut_ptr();
        let mut state = self.state.lock().expect("ring");
        let key = state.next;
        state.next += 1;
        let (done, receiver) = oneshot::channel();
        {
            let mut queue = state.ring.submission();
            for (i, op) in ops.iter().enumerate() {
                // SAFETY: `at + len` is within the window (checked in `read`), so the pointer stays inside
                // the window's allocation, which does not move when the `Buffer` does.
                let dest = unsafe { base.add(op.at) };
                let entry = io_uring::opcode::Read::new(io_uring::types::Fd(op.fd), dest, op.len as u32)
                    .offset(op.offset)
                    .build()
                    .user_data(key << OP_BITS | i as u64);
                // SAFETY: the entry's destination is a part of the buffer that no other entry shares (a
                // chunk's reads are disjoint by construction in `direct.rs`). The buffer is handed to
                // the ring below, before anything is submitted, and leaves it only when every read of
                // this submission has completed (or never, see `InFlight`), and so does `keep`, which holds
                // its descriptor open: an entry left queued is never submitted for a closed (or reused)
                // descriptor number. The queue has room: the slots held bound the reads queued or in
                // flight to its size.
                unsafe { queue.push(&entry) }.expect("the slots bound the queue");
            }
        }
        let n = ops.len();
        let (buffer, done) = (Some(buffer), Some(done));
        let flight = InFlight { buffer, results: vec![0; n], left: n, done, _slots: slots, keep: Some(keep) };
        state.reads.insert(key, flight);
        loop {
            match state.ring.submit() {
                Ok(_) => return Ok(receiver),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                // The kernel is short of memory or has completions to post first: the reads stay queued
                // and the driver submits them once it has reaped (or within a few milliseconds).
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => return Ok(receiver),
                Err(e) => {
                    // The kernel may have taken some of the reads: their buffer stays with the ring.
                    self.failed.store(true, Ordering::Relaxed);
                    tracing::error!(error = %e, "io_uring refused a submission: direct reads use pread from now on");
                    return Err(e);
                }
            }
        }
    }

    /// Whether the kernel refused a submission: the ring takes no more reads (read with `pread` instead).
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Submissions made so far.
    #[cfg(test)]
    pub fn submitted(&self) -> u64 {
        self.submitted.load(Ordering::Relaxed)
    }

    /// Reaps every completion, submits what a busy kernel left queued, and hands back each submission
    /// whose reads are all done. Returns whether reads are still queued unsubmitted.
    fn reap(&self) -> bool {
        let mut finished = Vec::new();
        let mut guard = self.state.lock().expect("ring");
        let state = &mut *guard;
        for entry in state.ring.completion() {
            let key = entry.user_data() >> OP_BITS;
            let i = (entry.user_data() & ((1 << OP_BITS) - 1)) as usize;
            let Some(flight) = state.reads.get_mut(&key) else { continue };
            flight.results[i] = entry.result();
            flight.left -= 1;
            if flight.left == 0 {
                finished.extend(state.reads.remove(&key));
            }
        }
        if !state.ring.submission().is_empty() && !self.failed.load(Ordering::Relaxed) {
            let _ = state.ring.submit();
        }
        let queued = !state.ring.submission().is_empty();
        drop(guard);
        for mut flight in finished {
            if let (Some(buffer), Some(done)) = (flight.buffer.take(), flight.done.take()) {
                // A chunk that is gone drops its buffer here: back to the pool, the kernel done with it.
                let _ = done.send((buffer, std::mem::take(&mut flight.results)));
            }
        }
        queued
    }
}

/// Reaps `ring` whenever its eventfd says completions were posted, until the ring is dropped.
async fn drive(ring: Weak<Ring>, eventfd: AsyncFd<OwnedFd>, mut stopped: oneshot::Receiver<()>) {
    let mut queued = false;
    loop {
        let retry = async {
            if queued {
                tokio::time::sleep(Duration::from_millis(5)).await
            } else {
                std::future::pending().await
            }
        };
        tokio::select! {
            _ = &mut stopped => return,
            _ = retry => {}
            ready = eventfd.readable() => {
                let Ok(mut ready) = ready else { return };
                let mut count = [0u8; 8];
                // SAFETY: reads at most 8 bytes into `count`, which has 8. Nothing to read (a spurious
                // wake) is fine: the reap below finds nothing.
                unsafe { libc::read(eventfd.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
                // Every completion posted after the read signals the eventfd again, and wakes this anew.
                ready.clear_ready();
            }
        }
        let Some(ring) = ring.upgrade() else { return };
        queued = ring.reap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ring, or `None` where the kernel refuses io_uring (a sandbox): the test says so and passes,
    /// except under CI (`CI` set), whose machines must have it.
    fn ring_or_skip() -> Option<Arc<Ring>> {
        match Ring::new() {
            Ok(ring) => Some(ring),
            Err(e) => {
                assert!(std::env::var_os("CI").is_none(), "CI must offer io_uring: {e}");
                eprintln!("io_uring unavailable here ({e}): nothing to test");
                None
            }
        }
    }
    use crate::aligned::Pool;
    use std::future::Future;
    use std::io::Write;

    fn file() -> (std::fs::File, Vec<u8>) {
        let mut file = tempfile::tempfile().unwrap();
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        file.write_all(&bytes).unwrap();
        (file, bytes)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_land_where_asked_and_stop_short_at_the_end() {
        let Some(ring) = ring_or_skip() else { return };
        let (file, bytes) = file();
        let fd = file.as_raw_fd();
        // More ops than the ring holds at once, to read in rounds.
        let mut ops: Vec<ReadOp> =
            (0..600).map(|i| ReadOp { fd, offset: i * 97, at: i as usize * 100, len: 100 }).collect();
        ops.push(ReadOp { fd, offset: 99_900, at: 600 * 100, len: 300 });
        let pool = Pool::new(601 * 100, 1);
        let (mut buffer, results) = ring.read(pool.take(), &ops, Arc::new(())).await.unwrap();
        let window = buffer.window();
        for (op, result) in ops.iter().zip(&results) {
            let n = *result.as_ref().unwrap();
            let want = &bytes[op.offset as usize..(op.offset as usize + op.len).min(bytes.len())];
            assert_eq!(n, want.len());
            assert_eq!(&window[op.at..op.at + n], want);
        }
        // A read of a closed descriptor is that read's error, the others still land.
        let bad = [ReadOp { fd: -1, offset: 0, at: 0, len: 10 }, ReadOp { fd, offset: 5, at: 10, len: 10 }];
        let (mut buffer, results) = ring.read(buffer, &bad, Arc::new(())).await.unwrap();
        assert!(results[0].is_err());
        assert_eq!((results[1].as_ref().unwrap(), &buffer.window()[10..20]), (&10, &bytes[5..15]));
    }

    /// A read dropped while in flight gives its buffer back to the pool only once the kernel is done with
    /// it, and the ring serves later reads.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_read_keeps_its_buffer_until_the_kernel_is_done() {
        let Some(ring) = ring_or_skip() else { return };
        let (file, bytes) = file();
        let fd = file.as_raw_fd();
        let pool = Pool::new(1 << 16, 4);
        let ops: Vec<ReadOp> =
            (0..64).map(|i| ReadOp { fd, offset: i * 1000, at: i as usize * 1000, len: 1000 }).collect();
        {
            let read = ring.read(pool.take(), &ops, Arc::new(()));
            tokio::pin!(read);
            // Submitted on the first poll; then dropped, whether or not it is done.
            std::future::poll_fn(|cx| {
                let _ = read.as_mut().poll(cx);
                std::task::Poll::Ready(())
            })
            .await;
        }
        let start = std::time::Instant::now();
        while pool.idle() == 0 {
            assert!(start.elapsed() < Duration::from_secs(10), "the cancelled read's buffer never came back");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(ring.state.lock().unwrap().reads.len(), 0);
        let (mut buffer, results) = ring.read(pool.take(), &ops[..3], Arc::new(())).await.unwrap();
        assert_eq!(results.iter().map(|r| *r.as_ref().unwrap()).collect::<Vec<_>>(), [1000; 3]);
        assert_eq!(&buffer.window()[..3000], &bytes[..3000]);
    }

    /// A read dropped before its last completion leaves its files open until the kernel is done: a read
    /// a busy kernel left queued names its file by number only, and a chunk dropped meanwhile closed it
    /// (the last handle of a copy the tier evicted), so the read, submitted later, read whatever took
    /// that number (another copy, a client's socket).
    #[tokio::test(flavor = "current_thread")]
    async fn a_cancelled_read_keeps_its_files_open_until_the_kernel_is_done() {
        let Some(ring) = ring_or_skip() else { return };
        let file = Arc::new(file().0);
        let (fd, open) = (file.as_raw_fd(), Arc::downgrade(&file));
        let pool = Pool::new(1 << 16, 2);
        let ops = [ReadOp { fd, offset: 0, at: 0, len: 1000 }];
        {
            let read = ring.read(pool.take(), &ops, file);
            tokio::pin!(read);
            std::future::poll_fn(|cx| {
                let _ = read.as_mut().poll(cx);
                std::task::Poll::Ready(())
            })
            .await;
        }
        // The driver runs on this thread, and has not run since: the read is the ring's still.
        assert_eq!(ring.state.lock().unwrap().reads.len(), 1);
        assert!(open.upgrade().is_some(), "its file closed with its read the ring's");
        let start = std::time::Instant::now();
        while !ring.state.lock().unwrap().reads.is_empty() {
            assert!(start.elapsed() < Duration::from_secs(10), "the cancelled read never completed");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(open.upgrade().is_none(), "its file kept open past its read");
    }
}
