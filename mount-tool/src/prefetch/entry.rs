//! One entry of the cache: a batch fetched or being fetched, with its state (fetching, a verified body, or the
//! error that ended its fetch), whether a reader consumed it, when it was last touched, and its sealed memory file
//! once the kernel serves it (passthrough). Readers wait on it for the body; the fetch sets it.
//!
//! A verified body is its bytes as the server sent them ([`Content::Bytes`]), or, for `rolling/`'s indexed
//! layout, records placed at their slots ([`Content::Placed`]): the bytes of the records and where each
//! goes, the rest of the file zeros that are never stored (holes in its memory file, zero-filled reads).

use super::ReadError;
use crate::buffers::Partial;
use crate::sync::{Arc, AtomicBool, AtomicU32, AtomicU64, Condvar, Mutex};
use batchfs::mmap::MappedFile;
use bytes::Bytes;
use std::sync::Weak;
use std::time::{Duration, Instant};

pub(super) enum State {
    /// The body is on its way; into a buffer whose verified prefix readers may copy, once the attempt
    /// that fills it has started (each attempt brings its own).
    Fetching(Option<Arc<Partial>>),
    Ready(Content),
    Failed(ReadError),
}

/// A verified file as readers see it.
#[derive(Clone)]
pub(super) enum Content {
    /// The body as sent.
    Bytes(Bytes),
    /// Records placed at their slots.
    Placed(Placed),
}

/// A file made of records at fixed offsets, zeros between them (`rolling/`'s indexed layout).
#[derive(Clone)]
pub(super) struct Placed {
    /// Where the records' bytes are: the packed body, or the placed file's own mapping.
    pub bytes: Bytes,
    /// Each record, by its offset in the file.
    pub records: Arc<[Record]>,
    /// The file's size.
    pub len: u64,
}

/// One record of a [`Placed`] file: `len` bytes from `from` of its bytes, at `at` in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Record {
    pub at: u64,
    pub from: u64,
    pub len: u64,
}

impl Content {
    /// The bytes a memory file of this content holds: the whole body, or the records alone.
    pub(super) fn stored(&self) -> u64 {
        match self {
            Content::Bytes(b) => b.len() as u64,
            Content::Placed(p) => p.records.iter().map(|r| r.len).sum(),
        }
    }

    /// The content as bytes: a body as sent, or what a read of the whole of a placed file returns.
    pub(super) fn into_bytes(self) -> Bytes {
        match self {
            Content::Bytes(b) => b,
            placed => placed.read(0..placed.len()),
        }
    }

    pub(super) fn len(&self) -> u64 {
        match self {
            Content::Bytes(b) => b.len() as u64,
            Content::Placed(p) => p.len,
        }
    }

    /// Bytes `range` of the file (within it): a view of the body, or, across records and the zeros
    /// between them, a copy.
    pub(super) fn read(&self, range: std::ops::Range<u64>) -> Bytes {
        let p = match self {
            Content::Bytes(b) => return b.slice(range.start as usize..range.end as usize),
            Content::Placed(p) => p,
        };
        // The last record starting at or before the range, and those after it within the range.
        let first = p.records.partition_point(|r| r.at <= range.start).saturating_sub(1);
        let within = p.records[first..].iter().take_while(|r| r.at < range.end);
        if let Some(r) = p.records.get(first).filter(|r| r.at <= range.start && range.end <= r.at + r.len) {
            let from = (r.from + range.start - r.at) as usize;
            return p.bytes.slice(from..from + (range.end - range.start) as usize);
        }
        let mut out = vec![0u8; (range.end - range.start) as usize];
        for r in within {
            let (start, end) = (r.at.max(range.start), (r.at + r.len).min(range.end));
            if start < end {
                let from = (r.from + start - r.at) as usize;
                out[(start - range.start) as usize..(end - range.start) as usize]
                    .copy_from_slice(&p.bytes[from..from + (end - start) as usize]);
            }
        }
        Bytes::from(out)
    }

    /// Writes the file into `file` (empty): the body, or each record at its offset, the file's size set
    /// first so that the zeros between records are holes.
    pub(super) fn write_to(&self, file: &std::fs::File) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        match self {
            Content::Bytes(b) => file.write_all_at(b, 0),
            Content::Placed(p) => {
                file.set_len(p.len)?;
                for r in p.records.iter() {
                    file.write_all_at(&p.bytes[r.from as usize..(r.from + r.len) as usize], r.at)?;
                }
                Ok(())
            }
        }
    }

    /// The same file read from `mapped` (the mapping of the memory file it was written to).
    fn in_mapping(&self, mapped: Bytes) -> Content {
        match self {
            Content::Bytes(_) => Content::Bytes(mapped),
            Content::Placed(p) => {
                let records = p.records.iter().map(|r| Record { from: r.at, ..*r }).collect();
                Content::Placed(Placed { bytes: mapped, records, len: p.len })
            }
        }
    }
}

pub(super) struct Entry {
    pub state: Mutex<State>,
    pub changed: Condvar,
    /// A reader has read the batch's last byte, or closed it: first to go when room is needed.
    pub consumed: AtomicBool,
    /// When the batch was last read or opened, or its fetch started: nanoseconds of
    /// [`super::Prefetcher::clock`].
    pub touched: AtomicU64,
    /// The body as a sealed memory file, once one was asked for (FUSE passthrough). Held only to read or
    /// set it: choosing a batch to evict reads it, with the cache lock held.
    pub memfd: Mutex<Option<Arc<std::fs::File>>>,
    /// Held while the memory file is made (a whole body written), so it is made once.
    making: Mutex<()>,
    /// The memory file was handed to a reader (counted in `bytes_served` once).
    pub handed: AtomicBool,
    /// The attempt its fetch is at (0: the first; each a failed one more): a read waiting on past its
    /// `timeout` while bytes come does so only while none of its fetch's attempts fails.
    pub attempt: AtomicU32,
}

/// A body served from the mapping of its memory file (shared, so that the pool sees when the daemon's
/// last view of it is gone: [`crate::buffers::BufferPool::lend`]).
pub(super) struct MappedBody(Arc<MappedFile>);

impl AsRef<[u8]> for MappedBody {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

/// Seals a memory file holding a verified body, and maps it: the bytes the daemon reads, and the file the
/// kernel serves (passthrough).
pub(super) fn seal_file(file: std::fs::File) -> std::io::Result<(Bytes, Arc<std::fs::File>)> {
    seal_mapped(file).map(|(bytes, file, _)| (bytes, file))
}

/// [`seal_file`], with a handle on the daemon's mapping that tells when its last view is dropped.
pub(super) fn seal_mapped(file: std::fs::File) -> std::io::Result<(Bytes, Arc<std::fs::File>, Weak<MappedFile>)> {
    let file = crate::sys::seal(file)?;
    let map = Arc::new(MappedFile::open_file(&file)?);
    let mapping = Arc::downgrade(&map);
    let bytes = if map.is_empty() { Bytes::new() } else { Bytes::from_owner(MappedBody(map)) };
    Ok((bytes, Arc::new(file), mapping))
}

/// `content` in a new sealed memory file, and the same content read from the file's mapping.
pub(super) fn in_memfd(content: &Content) -> std::io::Result<(Content, Arc<std::fs::File>)> {
    let file = crate::sys::memory_file("batchfs-batch", content.len())?;
    content.write_to(&file)?;
    let (mapped, file) = seal_file(file)?;
    if mapped.len() as u64 != content.len() {
        return Err(std::io::Error::other("the memory file does not hold the whole body"));
    }
    Ok((content.in_mapping(mapped), file))
}

impl Entry {
    pub(super) fn new(now: u64) -> Self {
        Entry {
            touched: AtomicU64::new(now),
            state: Mutex::new(State::Fetching(None)),
            changed: Condvar::new(),
            consumed: AtomicBool::new(false),
            memfd: Mutex::new(None),
            making: Mutex::new(()),
            handed: AtomicBool::new(false),
            attempt: AtomicU32::new(0),
        }
    }

    pub(super) fn is_ready(&self) -> bool {
        matches!(*self.state.lock().expect("entry"), State::Ready(_))
    }

    /// Its fetch failed for good.
    pub(super) fn is_failed(&self) -> bool {
        matches!(*self.state.lock().expect("entry"), State::Failed(_))
    }

    /// Someone outside the cache holds the memory file (an open passthrough file): not to be evicted.
    pub(super) fn is_pinned(&self) -> bool {
        self.memfd.lock().expect("memfd").as_ref().is_some_and(|f| Arc::strong_count(f) > 1)
    }

    /// The memory file of `body` (this entry's verified body), made on first use: written, sealed, and
    /// mapped to serve the daemon's reads from the same pages (the body buffer is then released). With
    /// the bytes written now (0 when it existed).
    pub(super) fn backing(&self, body: Content) -> std::io::Result<(Arc<std::fs::File>, u64)> {
        let existing = || self.memfd.lock().expect("memfd").clone();
        if let Some(f) = existing() {
            return Ok((f, 0));
        }
        let _making = self.making.lock().expect("making");
        // Another open may have made it while this one waited.
        if let Some(f) = existing() {
            return Ok((f, 0));
        }
        let (mapped, file) = in_memfd(&body)?;
        *self.state.lock().expect("entry") = State::Ready(mapped);
        *self.memfd.lock().expect("memfd") = Some(file.clone());
        Ok((file, body.stored()))
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
    ) -> Result<(Content, bool, bool), ReadError> {
        let mut state = self.state.lock().expect("entry");
        let mut waited = false;
        loop {
            match (&*state, &range) {
                (State::Ready(c), None) => return Ok((c.clone(), waited, false)),
                (State::Ready(c), Some(r)) => return Ok((Content::Bytes(c.read(r.clone())), waited, false)),
                (State::Failed(e), _) => return Err(e.clone()),
                (State::Fetching(Some(p)), Some(r)) => {
                    if let Some(b) = p.slice(r.clone()) {
                        return Ok((Content::Bytes(b), waited, true));
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
