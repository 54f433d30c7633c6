//! The reads of one direct chunk, submitted together through io_uring.
//!
//! A chunk of a shuffled batch is a handful of ranges in different places of different shards. Read one
//! `pread` after another, each sleeps until the device answers: a context switch and a device
//! notification per range, which on a virtual machine's 2 cores cost more CPU than the copy they save.
//! Submitted together, the ranges go to the device in one call (one notification), are read in parallel,
//! and the thread sleeps once. Each blocking-pool thread keeps its own small ring, made when it first
//! reads. Where the kernel refuses io_uring (too old, disabled by `kernel.io_uring_disabled` or a seccomp
//! profile), [`read_all`] says so once and the caller reads with `pread`.

use std::cell::RefCell;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

/// Reads in flight at once on one ring (a chunk with more ranges is read in rounds).
const RING_ENTRIES: u32 = 64;

/// Set once io_uring is found unusable: every read takes `pread` after that.
static UNAVAILABLE: AtomicBool = AtomicBool::new(false);

thread_local! {
    static RING: RefCell<Option<io_uring::IoUring>> = const { RefCell::new(None) };
}

/// One read: `len` bytes of `fd` at `offset`, into `window[at..at + len]`.
#[derive(Debug, Clone, Copy)]
pub struct ReadOp {
    pub fd: RawFd,
    pub offset: u64,
    pub at: usize,
    pub len: usize,
}

/// Why [`read_all`] read nothing, or stopped.
#[derive(Debug)]
pub enum Failed {
    /// io_uring is not available here: read another way.
    Unavailable,
    /// The ring failed with reads possibly still in flight: the kernel may still write into the window,
    /// so its memory must never be used again (the caller leaks it).
    Abandoned(std::io::Error),
    /// The kernel refused the first submission, with nothing in flight (inside `read_all` only).
    Refused(std::io::Error),
}

/// Reads every op into `window` and returns each op's result (bytes read, which may be short at a file's
/// end, or the error), in order. Returns only once no read is in flight, except with `Abandoned`.
pub fn read_all(window: &mut [u8], ops: &[ReadOp]) -> Result<Vec<std::io::Result<usize>>, Failed> {
    if UNAVAILABLE.load(Ordering::Relaxed) {
        return Err(Failed::Unavailable);
    }
    for op in ops {
        assert!(op.at + op.len <= window.len() && op.len <= u32::MAX as usize, "a read past the window");
    }
    RING.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            match io_uring::IoUring::new(RING_ENTRIES) {
                Ok(ring) => *slot = Some(ring),
                Err(e) => {
                    if !UNAVAILABLE.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "io_uring unavailable: direct reads use pread");
                    }
                    return Err(Failed::Unavailable);
                }
            }
        }
        let ring = slot.as_mut().expect("made above");
        match read_rounds(ring, window, ops) {
            Err(Failed::Refused(e)) => {
                *slot = None;
                UNAVAILABLE.store(true, Ordering::Relaxed);
                tracing::warn!(error = %e, "io_uring refused a read: direct reads use pread");
                Err(Failed::Unavailable)
            }
            Err(Failed::Abandoned(e)) => {
                // The kernel may still complete reads into the window: keep the ring alive (never closed)
                // and make a fresh one next time; the caller never frees the window.
                std::mem::forget(slot.take());
                Err(Failed::Abandoned(e))
            }
            result => result,
        }
    })
}

fn read_rounds(
    ring: &mut io_uring::IoUring,
    window: &mut [u8],
    ops: &[ReadOp],
) -> Result<Vec<std::io::Result<usize>>, Failed> {
    let base = window.as_mut_ptr();
    let mut results: Vec<Option<std::io::Result<usize>>> = (0..ops.len()).map(|_| None).collect();
    for (round, batch) in ops.chunks(RING_ENTRIES as usize).enumerate() {
        let first = round * RING_ENTRIES as usize;
        for (i, op) in batch.iter().enumerate() {
            // SAFETY: `at + len` is within the window (checked in `read_all`), so the pointer stays inside
            // the window's allocation.
            let dest = unsafe { base.add(op.at) };
            let entry = io_uring::opcode::Read::new(io_uring::types::Fd(op.fd), dest, op.len as u32)
                .offset(op.offset)
                .build()
                .user_data((first + i) as u64);
            // SAFETY: the entry's buffer is a part of `window` that no other entry shares (the ops' ranges
            // are disjoint by construction in `body.rs`); `window` is borrowed mutably until this function
            // returns, and it returns only after every submitted read has completed (or with `Abandoned`,
            // whose caller never frees the window). The ring has room: at most RING_ENTRIES per round,
            // and every completion of the previous round was reaped.
            unsafe { ring.submission().push(&entry) }.expect("room for a round");
        }
        let mut done = 0;
        while done < batch.len() {
            match ring.submit_and_wait(batch.len() - done) {
                Ok(_) => {}
                Err(e) if is_transient(&e) => {}
                // The kernel took none of this round's reads (and every earlier one completed): nothing
                // is in flight, and dropping the ring drops the queued entries unread.
                Err(e) if done == 0 && ring.submission().len() == batch.len() => return Err(Failed::Refused(e)),
                Err(e) => return Err(Failed::Abandoned(e)),
            }
            for cqe in ring.completion() {
                let n = cqe.user_data() as usize;
                let result = cqe.result();
                results[n] = Some(if result < 0 {
                    Err(std::io::Error::from_raw_os_error(-result))
                } else {
                    Ok(result as usize)
                });
                done += 1;
            }
        }
    }
    Ok(results.into_iter().map(|r| r.expect("every read completed")).collect())
}

fn is_transient(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn reads_land_where_asked_and_stop_short_at_the_end() {
        let mut file = tempfile::tempfile().unwrap();
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        file.write_all(&bytes).unwrap();
        let fd = file.as_raw_fd();
        // More ops than a ring holds, to read in rounds.
        let mut ops: Vec<ReadOp> =
            (0..150).map(|i| ReadOp { fd, offset: i * 97, at: i as usize * 300, len: 300 }).collect();
        ops.push(ReadOp { fd, offset: 99_900, at: 150 * 300, len: 300 });
        let mut window = vec![0u8; 151 * 300];
        let results = match read_all(&mut window, &ops) {
            Err(Failed::Unavailable) => return eprintln!("io_uring unavailable here: nothing to test"),
            other => other.unwrap(),
        };
        for (op, result) in ops.iter().zip(&results) {
            let n = *result.as_ref().unwrap();
            let want = &bytes[op.offset as usize..(op.offset as usize + op.len).min(bytes.len())];
            assert_eq!(n, want.len());
            assert_eq!(&window[op.at..op.at + n], want);
        }
        // A read of a closed descriptor is that read's error, the others still land.
        let bad = [ReadOp { fd: -1, offset: 0, at: 0, len: 10 }, ReadOp { fd, offset: 5, at: 10, len: 10 }];
        let results = read_all(&mut window, &bad).unwrap();
        assert!(results[0].is_err());
        assert_eq!((results[1].as_ref().unwrap(), &window[10..20]), (&10, &bytes[5..15]));
    }
}
