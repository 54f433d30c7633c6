//! Reads that failed after waiting out `timeout`, kept for a moment by file and thread. When a read through
//! the daemon fails, Linux asks again at once: its readahead's `READ` failed, so it reads the page the
//! reader wants alone (`filemap_read_folio`), the same thread asking for the same file. That second `READ`
//! waited out a `timeout` of its own, and a reader got its `EIO` after twice the `timeout` it had set. Now
//! a thread's reads of a file within [`REPEATED_WITHIN`] of one of its reads of that file failing so get
//! the same error at once; later reads, and other threads' reads, are new attempts with their own
//! `timeout`.

use super::FsError;
use crate::prefetch::ReadError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a failure answers a thread's next reads of the file at once: long enough for the kernel's
/// own repeat, which follows the failure by microseconds, on a loaded machine too.
pub const REPEATED_WITHIN: Duration = Duration::from_secs(1);

/// Entries kept before those past [`REPEATED_WITHIN`] are dropped (a failure each of this many threads
/// and files at once is an outage; the map stays this small however long it lasts).
const PRUNE_PAST: usize = 256;

/// The failures by (inode, thread), each with when it happened.
#[derive(Default)]
pub struct FailedReads {
    recent: Mutex<HashMap<(u64, u32), (Instant, FsError)>>,
    /// Whether `recent` holds any: a read while none failed takes no lock. A thread sees its own failures
    /// (program order), and only its own concern it.
    any: AtomicBool,
}

impl FailedReads {
    /// The error of thread `tid`'s read of `ino` that failed after waiting, if it failed within
    /// [`REPEATED_WITHIN`] of `now`.
    pub fn repeat(&self, ino: u64, tid: u32, now: Instant) -> Option<FsError> {
        if !self.any.load(Ordering::Relaxed) {
            return None;
        }
        let recent = self.recent.lock().expect("failed reads");
        let (at, e) = recent.get(&(ino, tid))?;
        (now.saturating_duration_since(*at) < REPEATED_WITHIN).then(|| e.clone())
    }

    /// Thread `tid`'s read of `ino` ended at `now` with `result`: a failure after waiting is kept, a success
    /// forgets an earlier one.
    pub fn record<T>(&self, ino: u64, tid: u32, result: &Result<T, FsError>, now: Instant) {
        let failed = matches!(result, Err(FsError::Io(ReadError::Timeout { .. })));
        if !failed && !self.any.load(Ordering::Relaxed) {
            return;
        }
        let mut recent = self.recent.lock().expect("failed reads");
        match result {
            Err(e) if failed => {
                if recent.len() >= PRUNE_PAST {
                    recent.retain(|_, (at, _)| now.saturating_duration_since(*at) < REPEATED_WITHIN);
                }
                recent.insert((ino, tid), (now, e.clone()));
            }
            // A success forgets this thread's failure, and those of the others that are too old to
            // repeat, so that once an outage is over reads take no lock again.
            _ => {
                recent.remove(&(ino, tid));
                recent.retain(|_, (at, _)| now.saturating_duration_since(*at) < REPEATED_WITHIN);
            }
        }
        self.any.store(!recent.is_empty(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout() -> Result<(), FsError> {
        Err(FsError::Io(ReadError::Timeout { after: Duration::from_secs(4), last: "down".into() }))
    }

    #[test]
    fn a_failure_after_waiting_answers_the_same_threads_next_reads_of_the_file_for_a_moment() {
        let failed = FailedReads::default();
        let t0 = Instant::now();
        assert_eq!(failed.repeat(7, 100, t0), None);
        failed.record(7, 100, &timeout(), t0);
        let soon = t0 + Duration::from_millis(5);
        assert_eq!(failed.repeat(7, 100, soon), timeout().err(), "the kernel's repeat");
        assert_eq!(failed.repeat(7, 100, soon), timeout().err(), "and a second one");
        assert_eq!(failed.repeat(7, 101, soon), None, "another thread tries for itself");
        assert_eq!(failed.repeat(8, 100, soon), None, "another file is tried");
        assert_eq!(failed.repeat(7, 100, t0 + REPEATED_WITHIN), None, "later reads try again");
        // A read that succeeds forgets the failure at once.
        failed.record(7, 100, &Ok::<_, FsError>(()), soon);
        assert_eq!(failed.repeat(7, 100, soon), None);
        // Once the failures are too old to repeat, a success anywhere clears them all: reads take no
        // lock again.
        failed.record(7, 100, &timeout(), t0);
        failed.record(9, 200, &Ok::<_, FsError>(()), soon);
        assert!(failed.any.load(Ordering::Relaxed), "a failure still to repeat");
        failed.record(9, 200, &Ok::<_, FsError>(()), t0 + REPEATED_WITHIN);
        assert!(!failed.any.load(Ordering::Relaxed));
    }

    #[test]
    fn only_failures_after_waiting_are_kept() {
        let failed = FailedReads::default();
        let t0 = Instant::now();
        for e in [FsError::NotFound, FsError::Io(ReadError::Refused("410 Gone".into()))] {
            failed.record(7, 100, &Err::<(), _>(e), t0);
            assert_eq!(failed.repeat(7, 100, t0), None);
        }
    }

    #[test]
    fn an_outage_of_many_threads_keeps_the_map_small() {
        let failed = FailedReads::default();
        let t0 = Instant::now();
        for tid in 0..10 * PRUNE_PAST as u32 {
            let at = t0 + REPEATED_WITHIN * (tid / 100);
            failed.record(1, tid, &timeout(), at);
        }
        let held = failed.recent.lock().unwrap().len();
        assert!(held <= PRUNE_PAST + 100, "{held} kept");
    }
}
