//! Copies into the disk tier being made, readable part by part as their parts land: a body that wants
//! bytes of an object the stager is copying waits for the parts that hold them (one `object_part` at
//! most, not the whole object) and reads them from the copy's file, instead of reading them from the
//! store a second time. Bytes of parts not on their way yet are not waited for: the body reads them by
//! GETs, so no batch waits for a copy to reach them. Every part is checked against the index's CRC32Cs
//! before it is written, so what a body reads here was checked as a copy in the tier was.
//!
//! An entry is made when a body asks for an object to be copied first, or when the stager starts a copy,
//! and ends when the copy is the tier's or has failed; a body that finds no entry, or whose parts do not
//! land in time, reads by GETs as before.

use std::fs::File;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// One copy being made (or asked for).
#[derive(Default)]
pub(super) struct Making {
    state: Mutex<State>,
    landed: Condvar,
}

#[derive(Default)]
struct State {
    /// The copy's file, once the stager has made it, the size of its parts, which are being read from
    /// the store and which have landed.
    file: Option<Arc<File>>,
    part: u64,
    started: Vec<bool>,
    done: Vec<bool>,
    /// The copy is the tier's now, or failed: nothing more lands.
    over: bool,
}

impl Making {
    /// The stager made the copy's `file`, to be written in `parts` parts of `part` bytes.
    pub fn begin(&self, file: Arc<File>, part: u64, parts: usize) {
        let mut state = self.state.lock().expect("making");
        (state.file, state.part, state.started, state.done) =
            (Some(file), part.max(1), vec![false; parts], vec![false; parts]);
    }

    /// Part `k` is being read from the store.
    pub fn started(&self, k: u64) {
        if let Some(started) = self.state.lock().expect("making").started.get_mut(k as usize) {
            *started = true;
        }
    }

    /// Part `k` is written (and was checked).
    pub fn landed(&self, k: u64) {
        let mut state = self.state.lock().expect("making");
        if let Some(done) = state.done.get_mut(k as usize) {
            *done = true;
        }
        self.landed.notify_all();
    }

    /// Nothing more lands (the copy is the tier's, or failed).
    pub fn end(&self) {
        self.state.lock().expect("making").over = true;
        self.landed.notify_all();
    }

    /// Waits until the parts holding `len` bytes at `offset` have landed, at most `within`, where each
    /// of them is on its way; returns the copy's file to read them from, or `None` where one of them is
    /// not being read yet (the copy not begun, or not that far: the caller reads the bytes itself rather
    /// than wait for the copy), the copy ended without them, or time ran out.
    pub fn wait(&self, offset: u64, len: u64, within: Duration) -> Option<Arc<File>> {
        let deadline = Instant::now() + within;
        let mut state = self.state.lock().expect("making");
        loop {
            let file = state.file.clone()?;
            let (first, last) = ((offset / state.part) as usize, ((offset + len.max(1) - 1) / state.part) as usize);
            if state.done.get(first..=last)?.iter().all(|&d| d) {
                return Some(file);
            }
            if !state.started.get(first..=last)?.iter().all(|&s| s) {
                return None;
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            if state.over {
                return None;
            }
            state = self.landed.wait_timeout(state, left).expect("making").0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_waits_for_its_parts_only_and_gives_up_when_the_copy_fails() {
        let making = Arc::new(Making::default());
        let file = Arc::new(tempfile::tempfile().unwrap());
        // Asked for before the copy began, or for a part not on its way: not waited for.
        assert!(making.wait(10, 5, Duration::from_secs(10)).is_none());
        making.begin(file, 100, 3);
        assert!(making.wait(10, 5, Duration::from_secs(10)).is_none());
        for k in 0..3 {
            making.started(k);
        }
        // On its way: waited for.
        let early = {
            let making = making.clone();
            std::thread::spawn(move || making.wait(10, 5, Duration::from_secs(10)).is_some())
        };
        std::thread::sleep(Duration::from_millis(20));
        // Parts 0 and 2 land: a range within part 0 is there, one over parts 1 and 2 is not yet.
        making.landed(0);
        making.landed(2);
        assert!(early.join().unwrap());
        assert!(making.wait(0, 100, Duration::ZERO).is_some());
        assert!(making.wait(150, 100, Duration::from_millis(20)).is_none(), "part 1 has not landed");
        let late = {
            let making = making.clone();
            std::thread::spawn(move || making.wait(150, 100, Duration::from_secs(10)).is_some())
        };
        std::thread::sleep(Duration::from_millis(20));
        making.landed(1);
        assert!(late.join().unwrap());
        // Past the object's end: never.
        assert!(making.wait(250, 100, Duration::ZERO).is_none());

        // A copy that fails wakes its readers at once, empty-handed.
        let failing = Arc::new(Making::default());
        failing.begin(Arc::new(tempfile::tempfile().unwrap()), 100, 2);
        failing.started(1);
        let waiting = {
            let failing = failing.clone();
            std::thread::spawn(move || {
                let started = Instant::now();
                (failing.wait(120, 10, Duration::from_secs(30)).is_none(), started.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        failing.end();
        let (none, waited) = waiting.join().unwrap();
        assert!(none && waited < Duration::from_secs(10));
    }
}
