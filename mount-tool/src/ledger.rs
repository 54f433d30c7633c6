//! The ledger: what the process serving a mount keeps where the next one finds it. The supervisor
//! (`supervise.rs`) creates it as a memory file and holds it with the mount's `/dev/fuse` descriptor;
//! each worker maps it shared and writes through to it as it goes, so a worker killed at any instant leaves
//! what its successor needs to serve the same handles and names the same way (docs/DESIGN.md, "Takeover").
//!
//! Four parts, all fixed in size (a memory file's untouched pages cost nothing):
//!
//! - **The header**: what the connection's `INIT` settled (passthrough on, re-send offered), the
//!   supervisor's counters (worker pid, restarts, the last takeover's time), and the largest backing id
//!   registered.
//! - **Handle slots**: one per open handle, its number being the slot's. A slot holds the inode, the
//!   opening process, the backing id of a passthrough open and the open request's id; its state word is
//!   written last (release order), so a slot is either whole or free. An open is recorded before it is
//!   answered, so a handle the kernel knows is always in the ledger; an open the kernel re-sends after a
//!   takeover is found by its request id and answered with the handle recorded for it.
//! - **Cells**: an insert-only open-addressing table of `u64` keys to `u64` values, for the views' state
//!   (`rolling/`'s counters and index-driven readers, `shuffled/`'s cursors). A value of 0 is no value.
//! - **The journal**: records appended in order (`raw/`'s listings, which number its tree as they come),
//!   each whole before the end word moves past it. Once a record does not fit, it takes no more: what it
//!   holds is always a prefix of what was appended. Beside it in the header, how many `raw/` nodes were
//!   numbered, so that a worker taking over from one whose listings outgrew the journal knows which
//!   numbers the kernel may hold that it cannot give back (`fs/views/raw/tree.rs`).
//!
//! A ledger of another layout (a worker of another version) is refused by its magic and version.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};

const MAGIC: u64 = u64::from_le_bytes(*b"BFSLEDGR");
const VERSION: u64 = 1;
const HEADER: usize = 4096;
/// Handle slots (open handles recorded; a handle beyond them is served but not handed over).
pub const SLOTS: usize = 1 << 16;
const SLOT_WORDS: usize = 4;
/// Cells of the views' state.
pub const CELLS: usize = 1 << 18;
const SLOTS_AT: usize = HEADER;
const CELLS_AT: usize = SLOTS_AT + SLOTS * SLOT_WORDS * 8;
const JOURNAL_AT: usize = CELLS_AT + CELLS * 16;
/// Bytes of the journal (`raw/`'s listings, in the order they numbered the tree).
pub const JOURNAL: usize = 16 << 20;
const LEN: usize = JOURNAL_AT + JOURNAL;

/// The header's words, by their place in it (the layout is the ledger's `VERSION`: append only).
#[derive(Clone, Copy)]
enum Header {
    Magic,
    Version,
    Settings,
    Restarts,
    WorkerPid,
    TakeoverUs,
    MaxBacking,
    SupervisorPid,
    JournalEnd,
    /// Not 0 once a record did not fit: the journal takes no more, so that it stays a prefix of what was
    /// appended (a shorter record after a refused one would leave a hole in the order).
    JournalFull,
    /// How many of `raw/`'s nodes were numbered, by any worker (0 from a ledger of an older release).
    RawNumbered,
}

const PASSTHROUGH: u64 = 1;
const RESEND: u64 = 2;
const SETTLED: u64 = 4;

/// What a recorded handle is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotKind {
    /// A file read through the daemon.
    Daemon,
    /// A file handed to the kernel: its backing id.
    Passthrough(u32),
    /// A passthrough file whose last handle was being released: its backing id is to be closed.
    Closing(u32),
    /// A handle of `.batchfs/stats`.
    Snapshot,
}

/// One recorded handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub fh: u64,
    pub ino: u64,
    pub owner: u32,
    /// The open request's id (without the kernel's re-send bit).
    pub unique: u64,
    pub kind: SlotKind,
}

/// What the connection's `INIT` settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub passthrough: bool,
    /// The kernel re-sends requests a dead worker had read (`FUSE_HAS_RESEND`).
    pub resend: bool,
}

/// The supervisor's counters, as a worker reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub supervisor_pid: u32,
    pub worker_pid: u32,
    pub restarts: u64,
    /// How long the last takeover left the mount without service: from the old worker's death to the new
    /// one serving (microseconds; 0 before the first).
    pub last_takeover_us: u64,
}

/// A mapped ledger.
pub struct Ledger {
    file: File,
    base: *mut AtomicU64,
    /// Bytes of the journal used ([`JOURNAL`]; fewer in tests, to fill it).
    journal: usize,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").field("settings", &self.settings()).field("counters", &self.counters()).finish()
    }
}

// SAFETY: the mapping is owned by the ledger, and every access to it goes through atomics (the journal's
// bytes are written past its end word by one writer at a time, and read only up to it).
unsafe impl Send for Ledger {}
// SAFETY: as for Send.
unsafe impl Sync for Ledger {}

impl Ledger {
    /// A new, empty ledger in a memory file.
    pub fn create() -> io::Result<Ledger> {
        let file = crate::sys::memfd("batchfs-ledger")?;
        file.set_len(LEN as u64)?;
        let ledger = Ledger::map(file)?;
        ledger.header(Header::Version).store(VERSION, Ordering::Relaxed);
        ledger.header(Header::Magic).store(MAGIC, Ordering::Release);
        Ok(ledger)
    }

    /// The ledger in `file` (handed over by the supervisor), checked to be of this layout.
    pub fn open(file: File) -> io::Result<Ledger> {
        if file.metadata()?.len() != LEN as u64 {
            return Err(io::Error::other("the mount's ledger has another size: written by another batchfs version"));
        }
        let ledger = Ledger::map(file)?;
        if ledger.header(Header::Magic).load(Ordering::Acquire) != MAGIC
            || ledger.header(Header::Version).load(Ordering::Relaxed) != VERSION
        {
            return Err(io::Error::other(
                "the mount's ledger is of another layout: written by another batchfs version",
            ));
        }
        Ok(ledger)
    }

    fn map(file: File) -> io::Result<Ledger> {
        // SAFETY: a fresh shared mapping of the whole file; unmapped on drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Ledger { file, base: ptr.cast(), journal: JOURNAL })
    }

    /// A new ledger whose journal holds `bytes` (at most [`JOURNAL`]): a full journal, in tests.
    #[cfg(test)]
    pub fn with_journal(bytes: usize) -> io::Result<Ledger> {
        let mut ledger = Ledger::create()?;
        ledger.journal = bytes.min(JOURNAL);
        Ok(ledger)
    }

    /// The memory file (to hand to a worker).
    pub fn file(&self) -> &File {
        &self.file
    }

    fn header(&self, word: Header) -> &AtomicU64 {
        self.word(word as usize)
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < LEN / 8);
        // SAFETY: in bounds of the mapping, which lives as long as `self`; u64-aligned (page-aligned base).
        unsafe { &*self.base.add(i) }
    }

    /// Records what `INIT` settled.
    pub fn settle(&self, s: Settings) {
        let bits = SETTLED | if s.passthrough { PASSTHROUGH } else { 0 } | if s.resend { RESEND } else { 0 };
        self.header(Header::Settings).store(bits, Ordering::Release);
    }

    /// What `INIT` settled, once recorded.
    pub fn settings(&self) -> Option<Settings> {
        let bits = self.header(Header::Settings).load(Ordering::Acquire);
        (bits & SETTLED != 0).then_some(Settings { passthrough: bits & PASSTHROUGH != 0, resend: bits & RESEND != 0 })
    }

    /// The supervisor's counters.
    pub fn counters(&self) -> Counters {
        Counters {
            supervisor_pid: self.header(Header::SupervisorPid).load(Ordering::Relaxed) as u32,
            worker_pid: self.header(Header::WorkerPid).load(Ordering::Relaxed) as u32,
            restarts: self.header(Header::Restarts).load(Ordering::Relaxed),
            last_takeover_us: self.header(Header::TakeoverUs).load(Ordering::Relaxed),
        }
    }

    /// The supervisor records a worker serving (after `takeover_us` without service, when it replaced one).
    pub fn worker_started(&self, supervisor: u32, pid: u32, takeover_us: Option<u64>) {
        self.header(Header::SupervisorPid).store(supervisor.into(), Ordering::Relaxed);
        self.header(Header::WorkerPid).store(pid.into(), Ordering::Relaxed);
        if let Some(us) = takeover_us {
            self.header(Header::TakeoverUs).store(us, Ordering::Relaxed);
            self.header(Header::Restarts).fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A backing id was registered with the kernel.
    pub fn backing_registered(&self, id: u32) {
        self.header(Header::MaxBacking).fetch_max(id.into(), Ordering::Relaxed);
    }

    /// The largest backing id registered on the connection.
    pub fn max_backing(&self) -> u32 {
        self.header(Header::MaxBacking).load(Ordering::Relaxed) as u32
    }

    fn slot_word(&self, slot: usize, w: usize) -> &AtomicU64 {
        self.word((SLOTS_AT / 8) + slot * SLOT_WORDS + w)
    }

    /// Records handle `fh` (`1..=SLOTS`): written whole before its state word.
    pub fn record(&self, s: &Slot) {
        let slot = (s.fh - 1) as usize;
        let (state, backing) = match s.kind {
            SlotKind::Daemon => (1, 0),
            SlotKind::Passthrough(id) => (2, id),
            SlotKind::Closing(id) => (3, id),
            SlotKind::Snapshot => (4, 0),
        };
        self.slot_word(slot, 0).store(s.ino, Ordering::Relaxed);
        self.slot_word(slot, 1).store(u64::from(s.owner) | u64::from(backing) << 32, Ordering::Relaxed);
        self.slot_word(slot, 2).store(s.unique, Ordering::Relaxed);
        self.slot_word(slot, 3).store(state, Ordering::Release);
    }

    /// Handle `fh` is gone.
    pub fn free(&self, fh: u64) {
        self.slot_word((fh - 1) as usize, 3).store(0, Ordering::Release);
    }

    /// Every recorded handle.
    pub fn slots(&self) -> Vec<Slot> {
        (0..SLOTS)
            .filter_map(|slot| {
                let state = self.slot_word(slot, 3).load(Ordering::Acquire);
                let word = self.slot_word(slot, 1).load(Ordering::Relaxed);
                let backing = (word >> 32) as u32;
                let kind = match state {
                    1 => SlotKind::Daemon,
                    2 => SlotKind::Passthrough(backing),
                    3 => SlotKind::Closing(backing),
                    4 => SlotKind::Snapshot,
                    _ => return None,
                };
                Some(Slot {
                    fh: slot as u64 + 1,
                    ino: self.slot_word(slot, 0).load(Ordering::Relaxed),
                    owner: word as u32,
                    unique: self.slot_word(slot, 2).load(Ordering::Relaxed),
                    kind,
                })
            })
            .collect()
    }

    fn cell(&self, i: usize) -> (&AtomicU64, &AtomicU64) {
        let at = CELLS_AT / 8 + i * 2;
        (self.word(at), self.word(at + 1))
    }

    /// Sets cell `key` (not 0) to `value`; false when the table is full (nothing recorded).
    pub fn set(&self, key: u64, value: u64) -> bool {
        debug_assert_ne!(key, 0);
        let mut i = (mix(key) as usize) % CELLS;
        for _ in 0..CELLS {
            let (k, v) = self.cell(i);
            match k.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    v.store(value, Ordering::Release);
                    return true;
                }
                Err(found) if found == key => {
                    v.store(value, Ordering::Release);
                    return true;
                }
                Err(_) => i = (i + 1) % CELLS,
            }
        }
        false
    }

    /// The value of cell `key`, if it has one.
    pub fn get(&self, key: u64) -> Option<u64> {
        let mut i = (mix(key) as usize) % CELLS;
        for _ in 0..CELLS {
            let (k, v) = self.cell(i);
            match k.load(Ordering::Acquire) {
                0 => return None,
                found if found == key => return Some(v.load(Ordering::Acquire)).filter(|&v| v != 0),
                _ => i = (i + 1) % CELLS,
            }
        }
        None
    }

    /// Every cell whose key's top byte is `tag`, as (key, value), values not 0.
    pub fn cells(&self, tag: u8) -> Vec<(u64, u64)> {
        (0..CELLS)
            .filter_map(|i| {
                let (k, v) = self.cell(i);
                let key = k.load(Ordering::Acquire);
                let value = v.load(Ordering::Acquire);
                (key != 0 && (key >> 56) as u8 == tag && value != 0).then_some((key, value))
            })
            .collect()
    }
}

impl Ledger {
    /// Appends `record` to the journal (one writer at a time: the caller's lock); false when it is full,
    /// and for every record after one that did not fit.
    pub fn append(&self, record: &[u8]) -> bool {
        if self.journal_full() {
            return false;
        }
        let end = self.header(Header::JournalEnd).load(Ordering::Acquire) as usize;
        let len = 4 + record.len();
        if end + len > self.journal {
            self.header(Header::JournalFull).store(1, Ordering::Release);
            return false;
        }
        // SAFETY: in bounds of the journal (checked above), past its end, where no reader looks yet.
        unsafe {
            let at = self.base.cast::<u8>().add(JOURNAL_AT + end);
            std::ptr::copy_nonoverlapping((record.len() as u32).to_le_bytes().as_ptr(), at, 4);
            std::ptr::copy_nonoverlapping(record.as_ptr(), at.add(4), record.len());
        }
        self.header(Header::JournalEnd).store((end + len) as u64, Ordering::Release);
        true
    }

    /// Bytes the journal has room for still.
    pub fn journal_room(&self) -> usize {
        self.journal.saturating_sub(self.header(Header::JournalEnd).load(Ordering::Acquire) as usize)
    }

    /// Appends nothing more to the journal (as if a record had not fit).
    pub fn close_journal(&self) {
        self.header(Header::JournalFull).store(1, Ordering::Release);
    }

    /// Forgets what this release keeps of the journal and of `raw/`'s numbers: the ledger as a release
    /// before them leaves it (tests).
    #[cfg(test)]
    pub fn as_left_by_an_older_release(&self) {
        self.header(Header::JournalFull).store(0, Ordering::Release);
        self.header(Header::RawNumbered).store(0, Ordering::Release);
    }

    /// Whether a record did not fit in the journal (no more are appended).
    pub fn journal_full(&self) -> bool {
        self.header(Header::JournalFull).load(Ordering::Acquire) != 0
    }

    /// `raw/` has `n` nodes numbered (the count only grows).
    pub fn raw_numbered(&self, n: u32) {
        self.header(Header::RawNumbered).fetch_max(n.into(), Ordering::AcqRel);
    }

    /// How many `raw/` nodes the workers so far numbered (0: not recorded, by an older release).
    pub fn raw_numbers(&self) -> u32 {
        self.header(Header::RawNumbered).load(Ordering::Acquire) as u32
    }

    /// The journal's records, in order.
    pub fn records(&self) -> Vec<Vec<u8>> {
        let end = self.header(Header::JournalEnd).load(Ordering::Acquire) as usize;
        // SAFETY: the journal's bytes up to its end, written whole before the end moved past them.
        let bytes = unsafe { std::slice::from_raw_parts(self.base.cast::<u8>().add(JOURNAL_AT), end.min(JOURNAL)) };
        let mut out = Vec::new();
        let mut at = 0;
        while at + 4 <= bytes.len() {
            let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
            let Some(record) = bytes.get(at + 4..at + 4 + len) else { break };
            out.push(record.to_vec());
            at += 4 + len;
        }
        out
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of LEN bytes.
        unsafe { libc::munmap(self.base.cast(), LEN) };
    }
}

/// A cell key: `tag` in the top byte, `rest` (below 2^56) under it.
pub fn key(tag: u8, rest: u64) -> u64 {
    debug_assert!(rest < 1 << 56);
    u64::from(tag) << 56 | rest
}

/// What a cell key holds under its tag (the `rest` of [`key`]).
pub fn rest(key: u64) -> u64 {
    key & ((1 << 56) - 1)
}

/// Cell tags of the views.
pub mod tags {
    /// `rolling/`: the epoch (+1) the next open of a name serves, by `batch << 3 | file`.
    pub const ROLLING_NEXT: u8 = 1;
    /// `rolling/`: an index-driven reader, by pid; its start time.
    pub const ROLLING_READER: u8 = 2;
    /// `shuffled/`: a class's cursor `(epoch << 24 | k) + 1`, by class.
    pub const SHUFFLED_CURSOR: u8 = 3;
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finalizer.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ledger as the next worker maps it: the same memory file, mapped again.
    fn reopened(l: &Ledger) -> Ledger {
        Ledger::open(l.file().try_clone().unwrap()).unwrap()
    }

    #[test]
    fn a_second_mapping_sees_the_handles_cells_and_settings_the_first_wrote() {
        let l = Ledger::create().unwrap();
        assert_eq!(l.settings(), None);
        l.settle(Settings { passthrough: true, resend: true });
        let a = Slot { fh: 1, ino: 1 << 62, owner: 42, unique: 9, kind: SlotKind::Passthrough(7) };
        let b = Slot { fh: SLOTS as u64, ino: 3, owner: 43, unique: 10, kind: SlotKind::Snapshot };
        let c = Slot { fh: 5, ino: 8, owner: 44, unique: 11, kind: SlotKind::Daemon };
        for s in [&a, &b, &c] {
            l.record(s);
        }
        l.free(5);
        assert!(l.set(key(tags::ROLLING_NEXT, 12), 4));
        assert!(l.set(key(tags::ROLLING_NEXT, 12), 5), "set again: updated");
        assert!(l.set(key(tags::SHUFFLED_CURSOR, 12), 6));
        l.backing_registered(7);
        l.backing_registered(3);
        l.worker_started(100, 200, None);
        l.worker_started(100, 201, Some(1500));
        let n = reopened(&l);
        assert_eq!(n.settings(), Some(Settings { passthrough: true, resend: true }));
        assert_eq!(n.slots(), vec![a, b]);
        assert_eq!(n.get(key(tags::ROLLING_NEXT, 12)), Some(5));
        assert_eq!(n.get(key(tags::ROLLING_NEXT, 13)), None);
        assert_eq!(n.cells(tags::ROLLING_NEXT), vec![(key(tags::ROLLING_NEXT, 12), 5)]);
        assert_eq!(n.max_backing(), 7);
        assert_eq!(
            n.counters(),
            Counters { supervisor_pid: 100, worker_pid: 201, restarts: 1, last_takeover_us: 1500 }
        );
    }

    #[test]
    fn the_journal_keeps_its_records_in_order_and_refuses_what_does_not_fit() {
        let l = Ledger::create().unwrap();
        assert!(l.append(b"one") && l.append(b"") && l.append(b"three"));
        assert_eq!(reopened(&l).records(), vec![b"one".to_vec(), vec![], b"three".to_vec()]);
        assert!(!l.append(&vec![0; JOURNAL]), "too large");
        assert!(!l.append(b"small"), "nothing after a record that did not fit: the journal stays a prefix");
        assert!(reopened(&l).journal_full() && !reopened(&l).append(b"x"));
        assert_eq!(l.records().len(), 3);
    }

    #[test]
    fn a_full_table_refuses_new_keys_and_keeps_the_old() {
        let l = Ledger::create().unwrap();
        for k in 1..=CELLS as u64 {
            assert!(l.set(key(1, k), k));
        }
        assert!(!l.set(key(1, CELLS as u64 + 1), 1), "full");
        assert!(l.set(key(1, 5), 50), "an existing key is still updated");
        assert_eq!((l.get(key(1, 5)), l.get(key(1, CELLS as u64))), (Some(50), Some(CELLS as u64)));
    }

    #[test]
    fn a_file_of_another_layout_is_refused() {
        let f = crate::sys::memfd("not-a-ledger").unwrap();
        f.set_len(LEN as u64).unwrap();
        assert!(Ledger::open(f).is_err(), "no magic");
        let short = crate::sys::memfd("short").unwrap();
        short.set_len(4096).unwrap();
        assert!(Ledger::open(short).is_err());
    }
}
