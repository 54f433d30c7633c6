//! Copies into the disk tier being made, readable part by part as their parts land: a body that wants
//! bytes of an object being copied asks for the parts that hold them, which the copy reads from the store
//! next (before the parts no body asked for), waits for them (an `object_part` each, never the whole
//! object) and reads them from the copy's file, instead of reading the same bytes from the store a second
//! time by GETs of its own. Every part is checked against the index's CRC32Cs before it is written, so
//! what a body reads here was checked as a copy in the tier was.
//!
//! An entry is made when a body asks for an object to be copied first, or when the stager starts a copy,
//! and ends when the copy is the tier's or has failed (or was not begun: no room beside the copies being
//! made); a body that finds no entry, whose copy ends without its parts, or whose parts do not land in
//! time, reads by GETs as before.

use std::collections::VecDeque;
use std::fs::File;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// One copy being made (or asked for).
#[derive(Default)]
pub(super) struct Making {
    state: Mutex<State>,
    /// Wakes readers: the copy began, a part landed, or it ended.
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// The copy's file, once the stager has made it (opened with `O_DIRECT` or not), the size of its
    /// parts, which are being read from the store and which have landed.
    file: Option<(Arc<File>, bool)>,
    part: u64,
    started: Vec<bool>,
    done: Vec<bool>,
    /// Parts bodies wait for and not started, in the order asked; the next part in order otherwise.
    asked: VecDeque<usize>,
    next: usize,
    /// The copy is the tier's now, or failed, or was not begun: nothing more lands.
    over: bool,
}

impl Making {
    /// The stager made the copy's `file` (opened with `O_DIRECT` where `direct`), to be written in `parts`
    /// parts of `part` bytes.
    pub fn begin(&self, file: Arc<File>, direct: bool, part: u64, parts: usize) {
        let mut state = self.state.lock().expect("making");
        (state.file, state.part, state.started, state.done) =
            (Some((file, direct)), part.max(1), vec![false; parts], vec![false; parts]);
        self.changed.notify_all();
    }

    /// The next part to read from the store, marked started: the first a body asked for, else the first
    /// in order not started; `None` when every part is started.
    pub fn next_part(&self) -> Option<u64> {
        let mut state = self.state.lock().expect("making");
        let state = &mut *state;
        while let Some(k) = state.asked.pop_front() {
            if !std::mem::replace(&mut state.started[k], true) {
                return Some(k as u64);
            }
        }
        while state.next < state.started.len() {
            let k = state.next;
            state.next += 1;
            if !std::mem::replace(&mut state.started[k], true) {
                return Some(k as u64);
            }
        }
        None
    }

    /// Part `k` is written (and was checked).
    pub fn landed(&self, k: u64) {
        let mut state = self.state.lock().expect("making");
        if let Some(done) = state.done.get_mut(k as usize) {
            *done = true;
        }
        self.changed.notify_all();
    }

    /// Nothing more lands (the copy is the tier's, failed, or was not begun).
    pub fn end(&self) {
        self.state.lock().expect("making").over = true;
        self.changed.notify_all();
    }

    /// Asks for the parts holding `len` bytes at `offset` to be read next, where the copy has begun and
    /// they are not started (a body asks for all it wants before it waits for any).
    pub fn ask(&self, offset: u64, len: u64) {
        let mut state = self.state.lock().expect("making");
        if let Some((first, last)) = state.parts_of(offset, len) {
            state.ask(first, last);
        }
    }

    /// Waits until the parts holding `len` bytes at `offset` have landed, at most `within` (the copy's
    /// beginning included), asking for them first; returns the copy's file to read them from (and whether
    /// it was opened with `O_DIRECT`), or `None`
    /// where the copy ended without them (failed, or not begun), the range is past the object's end, or
    /// time ran out: the caller then reads the bytes itself.
    pub fn wait(&self, offset: u64, len: u64, within: Duration) -> Option<(Arc<File>, bool)> {
        let deadline = Instant::now() + within;
        let mut state = self.state.lock().expect("making");
        let mut asked = false;
        loop {
            if let Some(file) = state.file.clone() {
                let (first, last) = state.parts_of(offset, len)?;
                if state.done[first..=last].iter().all(|&d| d) {
                    return Some(file);
                }
                if !std::mem::replace(&mut asked, true) {
                    state.ask(first, last);
                }
            }
            if state.over {
                return None;
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            state = self.changed.wait_timeout(state, left).expect("making").0;
        }
    }
}

impl State {
    /// The first and last parts holding `len` bytes at `offset`, where the copy has begun and they are
    /// within the object.
    fn parts_of(&self, offset: u64, len: u64) -> Option<(usize, usize)> {
        self.file.as_ref()?;
        let (first, last) = ((offset / self.part) as usize, ((offset + len.max(1) - 1) / self.part) as usize);
        (last < self.done.len()).then_some((first, last))
    }

    /// Parts `first..=last` are read next, those not started and not asked for already.
    fn ask(&mut self, first: usize, last: usize) {
        for k in first..=last {
            if !self.started[k] && !self.asked.contains(&k) {
                self.asked.push_back(k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter(making: &Arc<Making>, offset: u64, len: u64) -> std::thread::JoinHandle<bool> {
        let making = making.clone();
        std::thread::spawn(move || making.wait(offset, len, Duration::from_secs(30)).is_some())
    }

    #[test]
    fn the_parts_readers_wait_for_are_read_first_and_a_failed_copy_wakes_them() {
        let making = Arc::new(Making::default());
        // Asked for before the copy began: waited for (the copy begins, then the reader's part comes
        // first); an ask before the beginning asks nothing yet.
        making.ask(250, 10);
        let early = waiter(&making, 150, 10);
        std::thread::sleep(Duration::from_millis(30));
        making.begin(Arc::new(tempfile::tempfile().unwrap()), false, 100, 4);
        std::thread::sleep(Duration::from_millis(30));
        making.ask(350, 10);
        making.ask(120, 10); // part 1 again: asked once
        assert_eq!(making.next_part(), Some(1), "the part a reader waits for comes first");
        assert_eq!(making.next_part(), Some(3), "then the parts asked for, in order");
        assert_eq!(making.next_part(), Some(0), "then the rest in order");
        making.landed(3);
        assert!(!early.is_finished());
        making.landed(1);
        assert!(early.join().unwrap());
        // A range over parts 0 and 1 waits for both: 1 landed, 0 is on its way.
        let both = waiter(&making, 50, 100);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!both.is_finished());
        making.landed(0);
        assert!(both.join().unwrap());
        assert_eq!(making.next_part(), Some(2));
        assert_eq!(making.next_part(), None, "every part started");
        // Past the object's end: never.
        assert!(making.wait(350, 100, Duration::ZERO).is_none());
        // Time runs out: the reader reads by itself.
        assert!(making.wait(250, 10, Duration::from_millis(20)).is_none());

        // A copy that fails (or is not begun) wakes its readers at once, empty-handed.
        for begun in [true, false] {
            let failing = Arc::new(Making::default());
            if begun {
                failing.begin(Arc::new(tempfile::tempfile().unwrap()), false, 100, 2);
            }
            let started = Instant::now();
            let waiting = waiter(&failing, 120, 10);
            std::thread::sleep(Duration::from_millis(20));
            failing.end();
            assert!(!waiting.join().unwrap());
            assert!(started.elapsed() < Duration::from_secs(10));
        }
    }
}
