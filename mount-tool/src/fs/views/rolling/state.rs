//! `rolling/`'s state: which epoch the next open of each name serves, and which layout each reader gets
//! (docs/SEMANTICS.md, "rolling/").
//!
//! **Epochs.** Each name has a counter per layout, at `first_epoch` until its first open (readers of
//! the two layouts on one mount, a DALI pipeline and a tf.data one, each get every epoch in turn). An
//! open that got its file moves the name past the epoch it got: two opens that looked the name up
//! together share one epoch and move it once; an open that failed got no file and moves nothing. The
//! counters cycle through the span the job reads, `first_epoch..first_epoch + epochs` (after the last,
//! the first again, logged once), which is also the span the indexed layout's slots hold. A name's
//! `.idx` twin in the packed layout has its own counter too (a reader opens each once per pass); in the
//! indexed layout it is one file for every epoch and has none.
//!
//! **Held files.** In the packed layout a process that has a name open and looks it up again (a `stat`
//! by name right after the open: the `tfrecord` package takes a file's size so, and DALI its twins')
//! gets the file it has open, not the next one; once it has released it, the next. (An indexed file has
//! one size for every epoch, so nothing there needs it, and a reader's mapping, which holds its file open
//! until it is unmapped, must not keep its next pass on the same epoch.)
//!
//! **Layouts.** `packed` serves the epoch directories' files, for readers that read records in sequence;
//! `indexed` serves each name at fixed offsets (`batchfs::rolling`), for readers that read at the offsets
//! of a twin they read once. With `auto`, a reader is index-driven once its process has opened a twin in
//! `rolling/` (DALI reads every twin when its pipeline is built, before it opens a data file), and reads
//! the indexed layout from then on; a process that never opens a twin reads the packed one. A process is
//! known by its pid and start time, so a later process that reuses a pid starts over.

use super::RollingFile;
use crate::fs::views::undelivered::Undelivered;
use crate::ledger::{key, rest, tags, Ledger};
use crate::options::RollingMode;
use crate::sync::{AtomicBool, Mutex, Ordering};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// The layout one reader gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Packed,
    Indexed,
}

/// Handles of one file that one process has open: (process, epoch, handles).
type Held = (u32, u64, u32);

/// Index-driven reader processes remembered at most (the oldest are forgotten first).
const READERS_KEPT: usize = 4096;

pub struct RollingState {
    mode: RollingMode,
    first_epoch: u64,
    epochs: u64,
    /// The epoch the next open of each name serves, by (batch, file); absent: `first_epoch`.
    next: Mutex<HashMap<(u64, RollingFile), u64>>,
    /// Index-driven reader processes, as (pid, start time), oldest first.
    indexed: Mutex<VecDeque<(u32, u64)>>,
    /// Opens of packed files not released yet, by (batch, file).
    held: Mutex<HashMap<(u64, RollingFile), Vec<Held>>>,
    wrapped: AtomicBool,
    /// Files `(batch, file, epoch)` opened whose reads failed, none having succeeded since: at each last
    /// close of one, its name goes back to its epoch ([`Self::closed`]).
    undelivered: Undelivered<(u64, RollingFile, u64)>,
    /// Where the counters and readers are written through to, for a worker that takes over.
    ledger: Option<Arc<Ledger>>,
}

impl RollingState {
    /// The state of a `rolling/` serving `epochs` epochs from `first_epoch` in `mode`.
    pub fn new(mode: RollingMode, first_epoch: u64, epochs: u64) -> Self {
        RollingState {
            mode,
            first_epoch,
            epochs: epochs.max(1),
            next: Mutex::new(HashMap::new()),
            indexed: Mutex::new(VecDeque::new()),
            held: Mutex::new(HashMap::new()),
            wrapped: AtomicBool::new(false),
            undelivered: Undelivered::default(),
            ledger: None,
        }
    }

    /// Takes the counters and index-driven readers `ledger` holds (a worker before this one wrote them) and
    /// writes every change through to it. The held files come back with the handles ([`Self::hold`]).
    pub fn record_in(&mut self, ledger: Arc<Ledger>) {
        let mut next = self.next.lock().expect("rolling");
        for (k, epoch) in ledger.cells(tags::ROLLING_NEXT) {
            let name = rest(k);
            if let Some(file) = file_of(name & 7) {
                next.insert((name >> 3, file), epoch - 1);
            }
        }
        drop(next);
        let mut readers = self.indexed.lock().expect("readers");
        for (k, start) in ledger.cells(tags::ROLLING_READER) {
            let pid = rest(k) as u32;
            // A reader gone since (its pid reused or free) is forgotten.
            if crate::sys::start_time(pid) == Some(start) && readers.len() < READERS_KEPT {
                readers.push_back((pid, start));
            }
        }
        drop(readers);
        self.ledger = Some(ledger);
    }

    pub fn first_epoch(&self) -> u64 {
        self.first_epoch
    }

    /// The epoch the next open of `file` of name `batch` serves.
    pub fn epoch_of(&self, batch: u64, file: RollingFile) -> u64 {
        self.next.lock().expect("rolling").get(&(batch, file)).copied().unwrap_or(self.first_epoch)
    }

    /// The epoch of packed `file` of name `batch` that process `owner` has open, if any.
    pub fn held(&self, batch: u64, file: RollingFile, owner: u32) -> Option<u64> {
        let held = self.held.lock().expect("held");
        held.get(&(batch, file))?.iter().rev().find(|h| h.0 == owner && owner != 0).map(|h| h.1)
    }

    /// Process `owner` opened packed `file` of name `batch` of `epoch` (see [`Self::opened`]).
    pub fn hold(&self, batch: u64, file: RollingFile, epoch: u64, owner: u32) {
        if owner == 0 {
            return;
        }
        let mut held = self.held.lock().expect("held");
        let opens = held.entry((batch, file)).or_default();
        match opens.iter_mut().find(|h| h.0 == owner && h.1 == epoch) {
            Some(h) => h.2 += 1,
            None => opens.push((owner, epoch, 1)),
        }
    }

    /// Process `owner` released a handle of packed `file` of name `batch` of `epoch`.
    pub fn release(&self, batch: u64, file: RollingFile, epoch: u64, owner: u32) {
        let mut held = self.held.lock().expect("held");
        if let Some(opens) = held.get_mut(&(batch, file)) {
            if let Some(i) = opens.iter().position(|h| h.0 == owner && h.1 == epoch) {
                opens[i].2 -= 1;
                if opens[i].2 == 0 {
                    opens.swap_remove(i);
                }
            }
            if opens.is_empty() {
                held.remove(&(batch, file));
            }
        }
    }

    /// An open of `file` of name `batch` got its file, of `epoch`: the name moves on to the epoch after
    /// it (once, however many opens shared `epoch`), the first of the span after its last.
    pub fn opened(&self, batch: u64, file: RollingFile, epoch: u64) {
        let last = self.first_epoch + self.epochs - 1;
        let mut next = self.next.lock().expect("rolling");
        let at = next.entry((batch, file)).or_insert(self.first_epoch);
        if *at != epoch {
            // Another open that looked the name up with this one moved it already.
            return;
        }
        *at = if epoch >= last { self.first_epoch } else { epoch + 1 };
        if let Some(ledger) = &self.ledger {
            ledger.set(key(tags::ROLLING_NEXT, batch << 3 | code(file)), *at + 1);
        }
        if epoch >= last && !self.wrapped.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                first_epoch = self.first_epoch,
                epochs = self.epochs,
                "rolling/ served the last epoch of its span and starts over at first_epoch (a job reading more \
                 passes than `epochs` sees earlier epochs again; mount with epochs=N for N passes)"
            );
        }
    }

    /// A read of `file` of name `batch` of `epoch` failed (its batch did not come within `timeout`).
    /// Where the open came before the bytes (`passthrough=false`, or a kernel without passthrough), the
    /// open got its file and moved the name on: unless a later read of it succeeds, the name goes back
    /// at its last close, so that no epoch is skipped (as an open that fails moves nothing).
    pub fn read_failed(&self, batch: u64, file: RollingFile, epoch: u64) {
        self.undelivered.failed((batch, file, epoch));
    }

    /// A read of `file` of name `batch` of `epoch` succeeded: it is delivered.
    pub fn read_succeeded(&self, batch: u64, file: RollingFile, epoch: u64) {
        self.undelivered.succeeded(&(batch, file, epoch));
    }

    /// The last handle of `file` of name `batch` of `epoch` was closed: where no read of it has
    /// succeeded since one failed, the name goes back to `epoch` (unless another open moved it on since).
    pub fn closed(&self, batch: u64, file: RollingFile, epoch: u64) {
        if !self.undelivered.take(&(batch, file, epoch)) {
            return;
        }
        let last = self.first_epoch + self.epochs - 1;
        let after = if epoch >= last { self.first_epoch } else { epoch + 1 };
        let mut next = self.next.lock().expect("rolling");
        let at = next.entry((batch, file)).or_insert(self.first_epoch);
        if *at == after && after != epoch {
            tracing::info!(batch, epoch, "rolling/: a file no read of got: its name serves its epoch again");
            *at = epoch;
            if let Some(ledger) = &self.ledger {
                ledger.set(key(tags::ROLLING_NEXT, batch << 3 | code(file)), epoch + 1);
            }
        }
    }

    /// The layout process `owner` (0: unknown) reads.
    pub fn layout(&self, owner: u32) -> Layout {
        match self.mode {
            RollingMode::Packed => Layout::Packed,
            RollingMode::Indexed => Layout::Indexed,
            RollingMode::Auto => {
                let id = identity(owner);
                if id.is_some_and(|id| self.indexed.lock().expect("readers").contains(&id)) {
                    Layout::Indexed
                } else {
                    Layout::Packed
                }
            }
        }
    }

    /// The layout a twin is looked up in: packed only where every reader reads packed (a reader of a
    /// twin is index-driven).
    pub fn twin_layout(&self) -> Layout {
        match self.mode {
            RollingMode::Packed => Layout::Packed,
            RollingMode::Auto | RollingMode::Indexed => Layout::Indexed,
        }
    }

    /// Process `owner` opened a twin: with `auto`, it reads the indexed layout from now on.
    pub fn reads_twins(&self, owner: u32) {
        if self.mode != RollingMode::Auto {
            return;
        }
        let Some(id) = identity(owner) else { return };
        let mut readers = self.indexed.lock().expect("readers");
        if !readers.contains(&id) {
            if readers.len() >= READERS_KEPT {
                readers.pop_front();
            }
            readers.push_back(id);
            if let Some(ledger) = &self.ledger {
                ledger.set(key(tags::ROLLING_READER, id.0.into()), id.1);
            }
            tracing::info!(pid = owner, "a reader of rolling/'s twins: it reads the indexed layout");
        }
    }
}

/// A file's code in the ledger's keys.
fn code(file: RollingFile) -> u64 {
    match file {
        RollingFile::Packed => 1,
        RollingFile::PackedIndex => 2,
        RollingFile::Indexed => 3,
    }
}

fn file_of(code: u64) -> Option<RollingFile> {
    Some(match code {
        1 => RollingFile::Packed,
        2 => RollingFile::PackedIndex,
        3 => RollingFile::Indexed,
        _ => return None,
    })
}

/// A process as (pid, start time); `None` for an unknown or gone one.
fn identity(owner: u32) -> Option<(u32, u64)> {
    (owner != 0).then_some(())?;
    Some((owner, crate::sys::start_time(owner)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cycle_through_the_span_and_shared_opens_move_them_once() {
        use RollingFile::{Indexed, Packed, PackedIndex};
        let r = RollingState::new(RollingMode::Packed, 5, 3);
        assert_eq!(r.epoch_of(1, Packed), 5);
        r.opened(1, Packed, 5);
        r.opened(1, Packed, 5);
        assert_eq!(r.epoch_of(1, Packed), 6, "two opens of one lookup move the name once");
        r.opened(1, Packed, 6);
        assert_eq!(r.epoch_of(1, Packed), 7);
        r.opened(1, Packed, 7);
        assert_eq!(r.epoch_of(1, Packed), 5, "after the last epoch of the span, the first again");
        assert_eq!((r.epoch_of(1, PackedIndex), r.epoch_of(2, Packed)), (5, 5), "each name its own counter");
        assert_eq!(r.epoch_of(1, Indexed), 5, "and each layout");
    }

    #[test]
    fn a_new_worker_serves_each_name_the_epoch_the_last_one_would_have_and_knows_its_readers() {
        use RollingFile::{Indexed, Packed, PackedIndex};
        let ledger = Arc::new(Ledger::create().unwrap());
        let mut old = RollingState::new(RollingMode::Auto, 2, 4);
        old.record_in(ledger.clone());
        old.opened(0, Packed, 2);
        old.opened(0, Packed, 3);
        old.opened(7, PackedIndex, 2);
        old.opened(7, Indexed, 2);
        old.opened(9, Packed, 2);
        old.opened(9, Packed, 3);
        old.opened(9, Packed, 4);
        old.opened(9, Packed, 5);
        let me = std::process::id();
        old.reads_twins(me);
        let files = [(0, Packed), (7, PackedIndex), (7, Indexed), (7, Packed), (9, Packed), (1, Indexed)];
        let before: Vec<u64> = files.iter().map(|&(b, f)| old.epoch_of(b, f)).collect();
        assert_eq!(before, [4, 3, 3, 2, 2, 2]);
        drop(old);
        let mut new = RollingState::new(RollingMode::Auto, 2, 4);
        new.record_in(ledger.clone());
        let after: Vec<u64> = files.iter().map(|&(b, f)| new.epoch_of(b, f)).collect();
        assert_eq!(after, before, "every name where it was, the wrapped one too");
        assert_eq!(new.layout(me), Layout::Indexed, "an index-driven reader still is");
        new.opened(0, Packed, 4);
        let mut third = RollingState::new(RollingMode::Auto, 2, 4);
        third.record_in(ledger);
        assert_eq!(third.epoch_of(0, Packed), 5, "the new worker writes through too");
    }

    /// A file whose every read failed gives its name back its epoch at its close, until a read of it
    /// succeeds; a name another open moved on since stays where it is.
    #[test]
    fn a_file_no_read_got_gives_its_name_back_its_epoch() {
        use RollingFile::Packed;
        let r = RollingState::new(RollingMode::Packed, 5, 3);
        r.opened(2, Packed, 5);
        r.read_failed(2, Packed, 5);
        r.closed(2, Packed, 5);
        assert_eq!(r.epoch_of(2, Packed), 5, "back to the epoch no read got");
        // Given back once: an open served with no read through the daemon (passthrough) delivers it.
        r.opened(2, Packed, 5);
        r.closed(2, Packed, 5);
        assert_eq!(r.epoch_of(2, Packed), 6, "an open closed without a failed read moves on");
        r.closed(2, Packed, 5);
        assert_eq!(r.epoch_of(2, Packed), 6, "a close without a failure moves nothing back");
        r.opened(2, Packed, 6);
        r.read_failed(2, Packed, 6);
        r.closed(2, Packed, 6);
        assert_eq!(r.epoch_of(2, Packed), 6);
        r.opened(2, Packed, 6);
        r.read_failed(2, Packed, 6);
        r.read_succeeded(2, Packed, 6);
        r.closed(2, Packed, 5);
        assert_eq!(r.epoch_of(2, Packed), 7, "read at last: moved on");
        // The last epoch of the span, failed: back from the first to the last.
        r.opened(2, Packed, 7);
        r.read_failed(2, Packed, 7);
        r.closed(2, Packed, 7);
        assert_eq!(r.epoch_of(2, Packed), 7);
        // Moved on by another open since: left.
        r.opened(2, Packed, 7);
        r.read_failed(2, Packed, 7);
        r.opened(2, Packed, 5);
        r.closed(2, Packed, 7);
        assert_eq!(r.epoch_of(2, Packed), 6);
    }

    #[test]
    fn a_process_holding_a_packed_file_open_finds_it_by_name_until_it_releases_it() {
        use RollingFile::{Packed, PackedIndex};
        let r = RollingState::new(RollingMode::Packed, 0, 10);
        r.hold(3, Packed, 0, 77);
        r.hold(3, Packed, 0, 77);
        assert_eq!((r.held(3, Packed, 77), r.held(3, Packed, 78), r.held(3, PackedIndex, 77)), (Some(0), None, None));
        r.release(3, Packed, 0, 77);
        assert_eq!(r.held(3, Packed, 77), Some(0), "one handle left");
        r.release(3, Packed, 0, 77);
        assert_eq!(r.held(3, Packed, 77), None);
        assert_eq!(r.held(3, Packed, 0), None, "an unknown process holds nothing");
    }

    #[test]
    fn with_auto_a_process_that_opened_a_twin_reads_the_indexed_layout() {
        let me = std::process::id();
        let r = RollingState::new(RollingMode::Auto, 0, 10);
        assert_eq!((r.layout(me), r.twin_layout()), (Layout::Packed, Layout::Indexed));
        r.reads_twins(me);
        assert_eq!(r.layout(me), Layout::Indexed);
        let mut other = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        assert_eq!(r.layout(other.id()), Layout::Packed, "another process");
        assert_eq!(r.layout(0), Layout::Packed, "an unknown one");
        other.kill().unwrap();
        other.wait().unwrap();
        let packed = RollingState::new(RollingMode::Packed, 0, 10);
        packed.reads_twins(me);
        assert_eq!((packed.layout(me), packed.twin_layout()), (Layout::Packed, Layout::Packed));
        let indexed = RollingState::new(RollingMode::Indexed, 0, 10);
        assert_eq!(indexed.layout(0), Layout::Indexed);
    }
}
