//! The mount's open handles: which inode and process each handle is, how each open inode reads, and the
//! `.batchfs/stats` snapshot each handle of it reads. The FUSE adapter keeps one table and asks it at every
//! open and release; the rules are here, where unit tests reach them.
//!
//! **One mode per inode.** The kernel demands one backing file per inode at a time, and no mixing of
//! passthrough and daemon opens of one inode: an inode open in one mode is opened again in the same mode
//! (with the same backing file), whatever the new open asked for, until its last handle is released; the
//! mode (and with it the backing id) is handed back then, to be closed.
//!
//! **Takeover.** Under a supervisor every handle is a slot of the ledger (`ledger.rs`), so that a new
//! worker serves the same handles, in the same modes, with the same backing ids ([`Handles::restore`]).
//! A release the dead worker read, and may have done (its slot freed) before it died unanswered, is re-sent
//! to the new worker: it never releases a handle the new worker handed out, which may have that slot's
//! number ([`Handles::release_of`]).

use crate::ledger::{Ledger, Slot, SlotKind, SLOTS};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// How the open handles of one inode read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Through the kernel's page cache and the daemon.
    Daemon,
    /// From a backing file, in the kernel: its backing id.
    Passthrough(u32),
}

/// What one handle is.
enum Handle {
    /// A handle of a file: its inode and the process that opened it.
    File { ino: u64, owner: u32 },
    /// A handle of `.batchfs/stats`: it reads the one snapshot taken at its open (counters move between a
    /// reader's calls, and pieces of two snapshots would not be one JSON document).
    Snapshot(Arc<Vec<u8>>),
}

/// A released handle of a file.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    pub ino: u64,
    pub owner: u32,
    /// The inode's mode when this was its last handle (a backing id to close).
    pub last: Option<Mode>,
}

/// The open handles. With a ledger, each handle is a slot of it (its number is the slot's), recorded
/// before the open is answered, so that a new worker serves the same handles ([`Handles::restore`]).
pub struct Handles {
    inodes: HashMap<u64, (Mode, usize)>,
    handles: HashMap<u64, Handle>,
    next: u64,
    ledger: Option<Arc<Ledger>>,
    /// Free slots of the ledger, as handle numbers (the lowest last).
    free: Vec<u64>,
    /// The open handles this worker handed out (not restored from the ledger).
    here: HashSet<u64>,
}

impl Default for Handles {
    fn default() -> Self {
        Handles {
            inodes: HashMap::new(),
            handles: HashMap::new(),
            next: 1,
            ledger: None,
            free: Vec::new(),
            here: HashSet::new(),
        }
    }
}

impl Handles {
    /// The handles `ledger` records (a new worker's table: every handle the kernel has open, as the last
    /// worker had it), with `snapshot` for each `.batchfs/stats` handle; the backing ids of releases the
    /// last worker did not finish are returned, to be closed.
    pub fn restore(ledger: Arc<Ledger>, snapshot: impl Fn() -> Vec<u8>) -> (Handles, Vec<u32>) {
        let mut h = Handles { ledger: Some(ledger.clone()), ..Handles::default() };
        let mut closing = Vec::new();
        let mut used = vec![false; SLOTS + 1];
        for slot in ledger.slots() {
            used[slot.fh as usize] = true;
            match slot.kind {
                SlotKind::Snapshot => {
                    h.handles.insert(slot.fh, Handle::Snapshot(Arc::new(snapshot())));
                }
                SlotKind::Closing(id) => {
                    // Its inode's last handle, released: what was left is closing the backing id.
                    closing.push(id);
                    ledger.free(slot.fh);
                    used[slot.fh as usize] = false;
                }
                SlotKind::Daemon | SlotKind::Passthrough(_) => {
                    let mode = match slot.kind {
                        SlotKind::Passthrough(id) => Mode::Passthrough(id),
                        _ => Mode::Daemon,
                    };
                    h.handles.insert(slot.fh, Handle::File { ino: slot.ino, owner: slot.owner });
                    h.inodes.entry(slot.ino).or_insert((mode, 0)).1 += 1;
                }
            }
        }
        h.free = (1..=SLOTS as u64).rev().filter(|&fh| !used[fh as usize]).collect();
        (h, closing)
    }

    /// The ledger the handles are recorded in.
    pub fn ledger(&self) -> Option<&Arc<Ledger>> {
        self.ledger.as_ref()
    }

    /// The mode `ino` is open in, if it is open.
    pub fn mode(&self, ino: u64) -> Option<Mode> {
        self.inodes.get(&ino).map(|&(mode, _)| mode)
    }

    /// Every open handle of a file, as (handle, inode, process).
    pub fn files(&self) -> Vec<(u64, u64, u32)> {
        let files = self.handles.iter().filter_map(|(&fh, h)| match *h {
            Handle::File { ino, owner } => Some((fh, ino, owner)),
            Handle::Snapshot(_) => None,
        });
        files.collect()
    }

    /// The handle recorded for the open request `unique` (re-sent by the kernel after a takeover: the
    /// last worker recorded it and died before answering), with the mode it reads in.
    pub fn resent(&self, unique: u64) -> Option<(u64, Option<Mode>)> {
        let ledger = self.ledger.as_ref()?;
        let slot = ledger.slots().into_iter().find(|s| s.unique == unique)?;
        let ino = match self.handles.get(&slot.fh)? {
            Handle::File { ino, .. } => Some(*ino),
            Handle::Snapshot(_) => None,
        };
        Some((slot.fh, ino.and_then(|ino| self.mode(ino))))
    }

    /// A new handle of `ino` for `owner`, for open request `unique`: in the mode the inode is open in, else
    /// in `mode`. Returns the handle and the mode it reads in.
    pub fn open(&mut self, ino: u64, owner: u32, mode: Mode, unique: u64) -> (u64, Mode) {
        let (mode, count) = self.inodes.entry(ino).or_insert((mode, 0));
        *count += 1;
        let mode = *mode;
        let kind = match mode {
            Mode::Daemon => SlotKind::Daemon,
            Mode::Passthrough(id) => SlotKind::Passthrough(id),
        };
        let fh = self.next_handle(ino, owner, unique, kind);
        self.handles.insert(fh, Handle::File { ino, owner });
        self.here.insert(fh);
        (fh, mode)
    }

    /// A new handle of `.batchfs/stats` reading `snapshot`.
    pub fn open_snapshot(&mut self, snapshot: Vec<u8>, unique: u64) -> u64 {
        let fh = self.next_handle(crate::fs::STATS_FILE, 0, unique, SlotKind::Snapshot);
        self.handles.insert(fh, Handle::Snapshot(Arc::new(snapshot)));
        self.here.insert(fh);
        fh
    }

    /// The snapshot handle `fh` reads, if it is one of `.batchfs/stats`.
    pub fn snapshot(&self, fh: u64) -> Option<Arc<Vec<u8>>> {
        match self.handles.get(&fh) {
            Some(Handle::Snapshot(json)) => Some(json.clone()),
            _ => None,
        }
    }

    /// Releases handle `fh`: what it was, if it was a file's. The last handle of a passthrough inode
    /// stays recorded as closing until [`Self::closed`] says its backing id is closed.
    pub fn release(&mut self, fh: u64) -> Option<Released> {
        self.release_of(fh, false)
    }

    /// [`Self::release`] by a release request, `resent` if the kernel sent it again after a takeover (a
    /// dead worker read it). A re-sent release never releases a handle this worker handed out: the kernel
    /// knew that handle only from this worker's reply, after the release was first sent, so the release
    /// was of an earlier handle of the same number, whose slot the dead worker freed before it died.
    pub fn release_of(&mut self, fh: u64, resent: bool) -> Option<Released> {
        if resent && self.here.contains(&fh) {
            tracing::info!(fh, "a re-sent release of a handle released before the takeover: ignored");
            return None;
        }
        let handle = self.handles.remove(&fh)?;
        self.here.remove(&fh);
        let Handle::File { ino, owner } = handle else {
            self.forget(fh);
            return None;
        };
        let (_, count) = self.inodes.get_mut(&ino).expect("an open handle's inode is open");
        *count -= 1;
        let last = (*count == 0).then(|| self.inodes.remove(&ino).expect("open").0);
        match (last, &self.ledger) {
            (Some(Mode::Passthrough(id)), Some(ledger)) if fh <= SLOTS as u64 => {
                ledger.record(&Slot { fh, ino, owner, unique: 0, kind: SlotKind::Closing(id) })
            }
            _ => self.forget(fh),
        }
        Some(Released { ino, owner, last })
    }

    /// The backing id of released handle `fh` is closed: its slot is free.
    pub fn closed(&mut self, fh: u64) {
        self.forget(fh);
    }

    fn forget(&mut self, fh: u64) {
        if let Some(ledger) = self.ledger.as_ref().filter(|_| fh <= SLOTS as u64) {
            ledger.free(fh);
            self.free.push(fh);
        }
    }

    fn next_handle(&mut self, ino: u64, owner: u32, unique: u64, kind: SlotKind) -> u64 {
        if let Some(ledger) = &self.ledger {
            if let Some(fh) = self.free.pop() {
                ledger.record(&Slot { fh, ino, owner, unique, kind });
                return fh;
            }
            // Every slot taken: a handle beyond them is served, not handed over to a next worker.
            self.next = self.next.max(SLOTS as u64 + 1);
        }
        self.next += 1;
        self.next - 1
    }
}

/// Thread ids to process ids (FUSE reports the thread that made a request; the prefetcher is told its
/// process), read from `/proc` once per thread id and remembered; bounded (cleared when full: thread ids
/// are reused).
#[derive(Default)]
pub struct Owners(Mutex<HashMap<u32, u32>>);

impl Owners {
    /// Entries kept before the map starts over.
    const KEPT: usize = 4096;

    /// The process of thread `tid` (`tid` itself when `/proc` does not say).
    pub fn of(&self, tid: u32) -> u32 {
        let mut map = self.0.lock().expect("owners");
        if let Some(&pid) = map.get(&tid) {
            return pid;
        }
        let pid = crate::sys::thread_group(tid).unwrap_or(tid);
        if map.len() >= Self::KEPT {
            map.clear();
        }
        map.insert(tid, pid);
        pid
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inode_keeps_its_first_mode_until_its_last_handle_is_released() {
        let mut h = Handles::default();
        let (a, mode) = h.open(7, 100, Mode::Passthrough(9), 1);
        assert_eq!(mode, Mode::Passthrough(9));
        // A second open asking for the daemon joins the passthrough one, with its backing file.
        let (b, mode) = h.open(7, 200, Mode::Daemon, 2);
        assert_eq!(mode, Mode::Passthrough(9));
        assert_ne!(a, b);
        let (c, mode) = h.open(8, 100, Mode::Daemon, 3);
        assert_eq!(mode, Mode::Daemon);
        assert_eq!(h.release(a), Some(Released { ino: 7, owner: 100, last: None }));
        assert_eq!(h.mode(7), Some(Mode::Passthrough(9)));
        assert_eq!(h.release(b), Some(Released { ino: 7, owner: 200, last: Some(Mode::Passthrough(9)) }));
        assert_eq!(h.mode(7), None, "closed: the next open chooses again");
        assert_eq!(h.open(7, 100, Mode::Daemon, 4).1, Mode::Daemon);
        assert_eq!(h.release(a), None, "released twice");
        assert_eq!(h.release(c).unwrap().last, Some(Mode::Daemon));
    }

    #[test]
    fn a_stats_handle_reads_its_own_snapshot_and_is_no_files() {
        let mut h = Handles::default();
        let one = h.open_snapshot(b"{\"reads\":1}".to_vec(), 1);
        let two = h.open_snapshot(b"{\"reads\":2}".to_vec(), 2);
        let (file, _) = h.open(3, 1, Mode::Daemon, 3);
        assert_eq!(h.snapshot(one).unwrap().as_slice(), b"{\"reads\":1}");
        assert_eq!(h.snapshot(two).unwrap().as_slice(), b"{\"reads\":2}");
        assert!(h.snapshot(file).is_none());
        assert_eq!(h.release(one), None);
        assert!(h.snapshot(one).is_none());
        assert_eq!(h.release(file).unwrap().last, Some(Mode::Daemon));
    }

    #[test]
    fn a_new_worker_restores_every_handle_the_last_one_recorded() {
        let ledger = Arc::new(Ledger::create().unwrap());
        let mut old = Handles::restore(ledger.clone(), Vec::new).0;
        let (a, _) = old.open(7, 100, Mode::Passthrough(9), 11);
        let (b, _) = old.open(7, 200, Mode::Daemon, 12);
        let (c, _) = old.open(8, 100, Mode::Daemon, 13);
        let s = old.open_snapshot(b"old".to_vec(), 14);
        let (d, _) = old.open(9, 300, Mode::Passthrough(10), 15);
        // The last handle of 9 is being released when the worker dies: its backing id is left to close.
        assert_eq!(old.release(d).unwrap().last, Some(Mode::Passthrough(10)));
        old.release(c);
        drop(old);
        let (mut new, closing) = Handles::restore(ledger.clone(), || b"new".to_vec());
        assert_eq!(closing, vec![10]);
        let mut files = new.files();
        files.sort();
        assert_eq!(files, vec![(a, 7, 100), (b, 7, 200)]);
        assert_eq!((new.mode(7), new.mode(8), new.mode(9)), (Some(Mode::Passthrough(9)), None, None));
        assert_eq!(new.snapshot(s).unwrap().as_slice(), b"new", "a stats handle reads a fresh snapshot");
        assert_eq!(new.resent(12), Some((b, Some(Mode::Passthrough(9)))), "a re-sent open finds its handle");
        assert_eq!(new.resent(13), None, "released");
        // New handles take free slots, never a live one.
        let (e, mode) = new.open(7, 400, Mode::Daemon, 16);
        assert_eq!(mode, Mode::Passthrough(9));
        assert!(![a, b, s].contains(&e));
        assert_eq!(new.release(a).unwrap().last, None);
        assert_eq!(new.release(b).unwrap().last, None);
        assert_eq!(new.release(e).unwrap().last, Some(Mode::Passthrough(9)));
        new.closed(e);
        assert_eq!(ledger.slots().len(), 1, "only the stats handle is left");
    }

    #[test]
    fn a_thread_is_known_by_its_process() {
        let owners = Owners::default();
        let me = std::process::id();
        // `/proc/thread-self` is `PID/task/TID`.
        let tid = || -> u32 {
            let link = std::fs::read_link("/proc/thread-self").unwrap();
            link.to_str().unwrap().rsplit('/').next().unwrap().parse().unwrap()
        };
        let (told, tids) = std::sync::mpsc::channel();
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            told.send(tid()).unwrap();
            let _ = wait.recv();
        });
        let other = tids.recv().unwrap();
        assert_ne!(other, me);
        assert_eq!(owners.of(other), me, "a live thread of this process");
        drop(done);
        thread.join().unwrap();
        assert_eq!(owners.of(other), me, "remembered");
        assert_eq!(owners.of(tid()), me);
    }
}
