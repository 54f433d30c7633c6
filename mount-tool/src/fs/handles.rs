//! The mount's open handles: which inode and process each handle is, how each open inode reads, and the
//! `.batchfs/stats` snapshot each handle of it reads. The FUSE adapter keeps one table and asks it at every
//! open and release; the rules are here, where unit tests reach them.
//!
//! **One mode per inode.** The kernel demands one backing file per inode at a time, and no mixing of
//! passthrough and daemon opens of one inode: an inode open in one mode is opened again in the same mode
//! (with the same backing file), whatever the new open asked for, until its last handle is released; the
//! mode (and with it the backing file) is handed back then, to be dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// How the open handles of one inode read; `B` is what keeps a backing file registered with the kernel.
#[derive(Debug, PartialEq, Eq)]
pub enum Mode<B> {
    /// Through the kernel's page cache and the daemon.
    Daemon,
    /// From a backing file, in the kernel.
    Passthrough(B),
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
pub struct Released<B> {
    pub ino: u64,
    pub owner: u32,
    /// The inode's mode when this was its last handle (to be dropped: a backing file closes with it).
    pub last: Option<Mode<B>>,
}

/// The open handles.
pub struct Handles<B> {
    inodes: HashMap<u64, (Mode<B>, usize)>,
    handles: HashMap<u64, Handle>,
    next: u64,
}

impl<B> Default for Handles<B> {
    fn default() -> Self {
        Handles { inodes: HashMap::new(), handles: HashMap::new(), next: 1 }
    }
}

impl<B> Handles<B> {
    /// The mode `ino` is open in, if it is open.
    pub fn mode(&self, ino: u64) -> Option<&Mode<B>> {
        self.inodes.get(&ino).map(|(mode, _)| mode)
    }

    /// A new handle of `ino` for `owner`: in the mode the inode is open in, else in `mode`. Returns the
    /// handle and the mode it reads in.
    pub fn open(&mut self, ino: u64, owner: u32, mode: Mode<B>) -> (u64, &Mode<B>) {
        let fh = self.next_handle();
        self.handles.insert(fh, Handle::File { ino, owner });
        let (mode, count) = self.inodes.entry(ino).or_insert((mode, 0));
        *count += 1;
        (fh, mode)
    }

    /// A new handle of `.batchfs/stats` reading `snapshot`.
    pub fn open_snapshot(&mut self, snapshot: Vec<u8>) -> u64 {
        let fh = self.next_handle();
        self.handles.insert(fh, Handle::Snapshot(Arc::new(snapshot)));
        fh
    }

    /// The snapshot handle `fh` reads, if it is one of `.batchfs/stats`.
    pub fn snapshot(&self, fh: u64) -> Option<Arc<Vec<u8>>> {
        match self.handles.get(&fh) {
            Some(Handle::Snapshot(json)) => Some(json.clone()),
            _ => None,
        }
    }

    /// Releases handle `fh`: what it was, if it was a file's.
    pub fn release(&mut self, fh: u64) -> Option<Released<B>> {
        let Handle::File { ino, owner } = self.handles.remove(&fh)? else { return None };
        let (_, count) = self.inodes.get_mut(&ino).expect("an open handle's inode is open");
        *count -= 1;
        let last = (*count == 0).then(|| self.inodes.remove(&ino).expect("open").0);
        Some(Released { ino, owner, last })
    }

    fn next_handle(&mut self) -> u64 {
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
        let mut h = Handles::<&str>::default();
        let (a, mode) = h.open(7, 100, Mode::Passthrough("backing"));
        assert_eq!(*mode, Mode::Passthrough("backing"));
        // A second open asking for the daemon joins the passthrough one, with its backing file.
        let (b, mode) = h.open(7, 200, Mode::Daemon);
        assert_eq!(*mode, Mode::Passthrough("backing"));
        assert_ne!(a, b);
        let (c, mode) = h.open(8, 100, Mode::Daemon);
        assert_eq!(*mode, Mode::Daemon);
        assert_eq!(h.release(a), Some(Released { ino: 7, owner: 100, last: None }));
        assert_eq!(h.mode(7), Some(&Mode::Passthrough("backing")));
        assert_eq!(h.release(b), Some(Released { ino: 7, owner: 200, last: Some(Mode::Passthrough("backing")) }));
        assert_eq!(h.mode(7), None, "closed: the next open chooses again");
        assert_eq!(*h.open(7, 100, Mode::Daemon).1, Mode::Daemon);
        assert_eq!(h.release(a), None, "released twice");
        assert_eq!(h.release(c).unwrap().last, Some(Mode::Daemon));
    }

    #[test]
    fn a_stats_handle_reads_its_own_snapshot_and_is_no_files() {
        let mut h = Handles::<()>::default();
        let one = h.open_snapshot(b"{\"reads\":1}".to_vec());
        let two = h.open_snapshot(b"{\"reads\":2}".to_vec());
        let (file, _) = h.open(3, 1, Mode::Daemon);
        assert_eq!(h.snapshot(one).unwrap().as_slice(), b"{\"reads\":1}");
        assert_eq!(h.snapshot(two).unwrap().as_slice(), b"{\"reads\":2}");
        assert!(h.snapshot(file).is_none());
        assert_eq!(h.release(one), None);
        assert!(h.snapshot(one).is_none());
        assert_eq!(h.release(file).unwrap().last, Some(Mode::Daemon));
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
