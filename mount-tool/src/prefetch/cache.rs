//! The cache's entries: one per batch fetched or being fetched, with its state (fetching, a verified
//! body, or the error that ended its fetch), what the budget was charged for it, whether a reader consumed
//! it, when it was last touched, and its sealed memory file once the kernel serves it (passthrough). And
//! the one rule of what to evict first.

use super::{BatchKey, ReadError};
use crate::client::Partial;
use crate::sync::{Arc, AtomicBool, AtomicU64, Condvar, Mutex, Ordering};
use bytes::Bytes;
use lru::LruCache;
use std::time::{Duration, Instant};

pub(super) enum State {
    /// The body is on its way; into a buffer whose verified prefix readers may copy, once the attempt
    /// that fills it has started (each attempt brings its own).
    Fetching(Option<Arc<Partial>>),
    Ready(Bytes),
    Failed(ReadError),
}

pub(super) struct Entry {
    /// Bytes charged to the budget: the body's size, or the capacity of the reused buffer it fills.
    pub size: u64,
    pub state: Mutex<State>,
    pub changed: Condvar,
    /// A reader has read the batch's last byte, or closed it: first to go when room is needed.
    pub consumed: AtomicBool,
    /// When the batch was last read or opened, or its fetch started: nanoseconds of
    /// [`super::Prefetcher::clock`].
    pub touched: AtomicU64,
    /// The body as a sealed memory file, once one was asked for (FUSE passthrough).
    pub memfd: Mutex<Option<Arc<std::fs::File>>>,
    /// The memory file was handed to a reader (counted in `bytes_served` once).
    pub handed: AtomicBool,
}

/// A body served from the mapping of its memory file.
pub(super) struct MappedBody(batchfs::mmap::MappedFile);

impl AsRef<[u8]> for MappedBody {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

/// Seals a memory file holding a verified body, and maps it: the bytes the daemon reads, and the file the
/// kernel serves (passthrough).
pub(super) fn seal_file(file: std::fs::File) -> std::io::Result<(Bytes, Arc<std::fs::File>)> {
    crate::sys::seal(&file)?;
    let map = batchfs::mmap::MappedFile::open_file(&file)?;
    let bytes = if map.is_empty() { Bytes::new() } else { Bytes::from_owner(MappedBody(map)) };
    Ok((bytes, Arc::new(file)))
}

impl Entry {
    pub(super) fn new(size: u64, now: u64) -> Self {
        Entry {
            size,
            touched: AtomicU64::new(now),
            state: Mutex::new(State::Fetching(None)),
            changed: Condvar::new(),
            consumed: AtomicBool::new(false),
            memfd: Mutex::new(None),
            handed: AtomicBool::new(false),
        }
    }

    pub(super) fn is_ready(&self) -> bool {
        matches!(*self.state.lock().expect("entry"), State::Ready(_))
    }

    /// Someone outside the cache holds the memory file (an open passthrough file): not to be evicted.
    pub(super) fn is_pinned(&self) -> bool {
        self.memfd.lock().expect("memfd").as_ref().is_some_and(|f| Arc::strong_count(f) > 1)
    }

    /// The memory file of `body` (this entry's verified body), made on first use: written, sealed, and
    /// mapped to serve the daemon's reads from the same pages (the body buffer is then released). With
    /// the bytes written now (0 when it existed).
    pub(super) fn backing(&self, body: Bytes) -> std::io::Result<(Arc<std::fs::File>, u64)> {
        use std::io::Write;
        let mut slot = self.memfd.lock().expect("memfd");
        if let Some(f) = &*slot {
            return Ok((f.clone(), 0));
        }
        let mut file = crate::sys::memfd("batchfs-batch")?;
        file.write_all(&body)?;
        let (mapped, file) = seal_file(file)?;
        if mapped.len() != body.len() {
            return Err(std::io::Error::other("the memory file does not hold the whole body"));
        }
        *self.state.lock().expect("entry") = State::Ready(mapped);
        *slot = Some(file.clone());
        Ok((file, body.len() as u64))
    }

    pub(super) fn set(&self, state: State) {
        *self.state.lock().expect("entry") = state;
        self.changed.notify_all();
    }

    /// A new attempt fills `partial` (while the batch is still being fetched).
    pub(super) fn filling(&self, partial: Arc<Partial>) {
        let mut state = self.state.lock().expect("entry");
        if let State::Fetching(p) = &mut *state {
            *p = Some(partial);
        }
    }

    /// Wakes the readers waiting for more of the body to be verified.
    pub(super) fn verified_more(&self) {
        // Taking the lock orders this after a waiter's check of the verified length: no lost wakeup.
        drop(self.state.lock().expect("entry"));
        self.changed.notify_all();
    }

    /// Waits until the body can be read, verified (at most until `deadline`): all of it (`range` None)
    /// when the fetch ends; bytes `range` when the fetch ends or, into a buffer, as soon as they are
    /// verified. Returns them, whether it had to wait, and whether they came before the whole body.
    pub(super) fn wait(
        &self,
        range: Option<std::ops::Range<u64>>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(Bytes, bool, bool), ReadError> {
        let mut state = self.state.lock().expect("entry");
        let mut waited = false;
        loop {
            match (&*state, &range) {
                (State::Ready(b), None) => return Ok((b.clone(), waited, false)),
                (State::Ready(b), Some(r)) => return Ok((b.slice(r.start as usize..r.end as usize), waited, false)),
                (State::Failed(e), _) => return Err(e.clone()),
                (State::Fetching(Some(p)), Some(r)) => {
                    if let Some(b) = p.slice(r.clone()) {
                        return Ok((b, waited, true));
                    }
                }
                (State::Fetching(_), _) => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ReadError::Timeout { after: timeout, last: "the fetch did not finish in time".into() });
            }
            waited = true;
            state = self.changed.wait_timeout(state, deadline - now).expect("entry").0;
        }
    }
}

pub(super) struct Cache {
    pub entries: LruCache<BatchKey, Arc<Entry>>,
}

impl Cache {
    /// Picks the entry to evict at `now` (nanoseconds of the prefetcher's clock), least recently used
    /// first and never one whose memory file is open: a consumed ready batch; else one nobody read or
    /// asked for in `stale_after` (a window that ran past where its reader stopped: the start of an epoch
    /// never read, a wrap-around that did not come); else, for reads only, any ready batch. Without the
    /// second rule such batches filled a small cache for good, and prefetch stopped: every batch then cost
    /// a round trip.
    pub fn victim(&self, now: u64, stale_after: Duration, any_ready: bool) -> Option<BatchKey> {
        let ready = |e: &Entry| e.is_ready() && !e.is_pinned();
        let stale_after = stale_after.as_nanos() as u64;
        let stale = |e: &Entry| now.saturating_sub(e.touched.load(Ordering::Relaxed)) >= stale_after;
        let lru = || self.entries.iter().rev();
        lru()
            .find(|(_, e)| e.consumed.load(Ordering::Relaxed) && ready(e))
            .or_else(|| lru().find(|(_, e)| stale(e) && ready(e)))
            .or_else(|| if any_ready { lru().find(|(_, e)| ready(e)) } else { None })
            .map(|(k, _)| *k)
    }
}
