//! Requests that may wait on the network (a read or an open of what is not cached, a lookup or a listing
//! that needs a manifest) run on the FUSE thread that took them while fewer than `threads - 1` FUSE threads
//! are in such work, and on a helper thread beyond that: one FUSE thread always stays free for the requests
//! behind them (the stats file, a listing, a read of what is cached) however long a server outage makes the
//! waits. Without it, as many readers waiting out an outage as there are FUSE threads left the stats file
//! and `ls` unanswered until their reads timed out, and each read's `timeout` began only when a thread took
//! it. The helpers are a pool of at most [`MOST_HELPERS`] threads, made when needed and ended after
//! [`HELPER_IDLE`] with nothing to do; work beyond them waits in order for one. A helper that cannot be
//! started (a pids limit: `EAGAIN`) while none runs leaves the work to the FUSE thread that asked, which
//! runs it there (see [`Helpers::run`]): queued, it would wait for a helper that may never come.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Helper threads at most.
pub const MOST_HELPERS: usize = 256;
/// A helper with nothing to do for this long ends.
pub const HELPER_IDLE: Duration = Duration::from_secs(10);

type Job = Box<dyn FnOnce() + Send>;

/// Starts a helper thread running its argument (a seam: the tests' refuses, as a pids limit does).
type Spawn = fn(Job) -> std::io::Result<()>;

fn spawn_helper(serve: Job) -> std::io::Result<()> {
    std::thread::Builder::new().name("batchfs-wait".into()).spawn(serve).map(drop)
}

/// Where work that may wait runs.
pub struct Waits {
    /// FUSE threads in work that may wait, now.
    inline: AtomicUsize,
    /// How many may be.
    limit: usize,
    helpers: Arc<Helpers>,
}

impl Waits {
    /// For a session of `threads` FUSE threads.
    pub fn new(threads: usize) -> Self {
        Waits { inline: AtomicUsize::new(0), limit: threads.saturating_sub(1), helpers: Arc::new(Helpers::default()) }
    }

    /// Runs `work` here, on the calling FUSE thread, if fewer than `threads - 1` FUSE threads are in such work
    /// now; otherwise hands it to a helper thread. A FUSE ring's lane (`fuse_uring`) runs it itself: the
    /// ring starts lanes ahead whenever a request leaves fewer than two of a CPU's idle.
    pub fn run(&self, work: impl FnOnce() + Send + 'static) {
        if fuser::served_by_ring() {
            // A lane of a FUSE ring holds one request: its CPU's next ones go to other lanes, which
            // the ring keeps idle ones of however many wait.
            work();
        } else if self.inline.fetch_add(1, Ordering::AcqRel) < self.limit {
            let _counted = Counted(&self.inline);
            work();
        } else {
            self.inline.fetch_sub(1, Ordering::AcqRel);
            self.helpers.clone().run(Box::new(work));
        }
    }

    /// Helper threads now, and those of them idle.
    #[cfg(test)]
    fn helpers(&self) -> (usize, usize) {
        let pool = self.helpers.pool.lock().expect("helpers");
        (pool.threads, pool.idle)
    }
}

/// Counts a FUSE thread out of its work when the work ends, a panic included.
struct Counted<'a>(&'a AtomicUsize);

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Helpers {
    pool: Mutex<Pool>,
    work: Condvar,
    spawn: Spawn,
}

impl Default for Helpers {
    fn default() -> Self {
        Helpers { pool: Mutex::default(), work: Condvar::new(), spawn: spawn_helper }
    }
}

#[derive(Default)]
struct Pool {
    jobs: VecDeque<Job>,
    threads: usize,
    idle: usize,
}

impl Helpers {
    /// Queues `job` for a helper, starting one if none is idle. If one cannot be started while none runs,
    /// the caller runs what is queued itself: nothing else would, and its replies would never be sent (not
    /// even EIO). Run, not failed: a pids limit passes, and the request can be served as well here; what is
    /// lost meanwhile is the free FUSE thread, for waits that the prefetcher bounds (`timeout`).
    fn run(self: Arc<Self>, job: Job) {
        let mut pool = self.pool.lock().expect("helpers");
        pool.jobs.push_back(job);
        // An idle helper for each job waiting, this one included: one of them takes it.
        if pool.idle >= pool.jobs.len() {
            self.work.notify_one();
            return;
        }
        if pool.threads >= MOST_HELPERS {
            return;
        }
        pool.threads += 1;
        drop(pool);
        let helpers = self.clone();
        if let Err(e) = (self.spawn)(Box::new(move || helpers.serve())) {
            let mut pool = self.pool.lock().expect("helpers");
            pool.threads -= 1;
            if pool.threads > 0 {
                // A helper runs: it takes the job when it is done with its own (an idle one, now).
                self.work.notify_one();
                tracing::warn!(error = %e, "cannot start a helper thread: the job waits for a running one");
                return;
            }
            tracing::warn!(error = %e, "cannot start a helper thread, and none runs: the FUSE thread runs the job");
            let jobs: Vec<Job> = pool.jobs.drain(..).collect();
            drop(pool);
            for job in jobs {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            }
        }
    }

    /// A helper's life: jobs in order until none comes for [`HELPER_IDLE`].
    fn serve(&self) {
        let mut pool = self.pool.lock().expect("helpers");
        loop {
            if let Some(job) = pool.jobs.pop_front() {
                drop(pool);
                // A job that panics has sent no reply (the kernel answers its request when the session
                // ends); the helper goes on.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                pool = self.pool.lock().expect("helpers");
                continue;
            }
            pool.idle += 1;
            let (next, waited) = self.work.wait_timeout(pool, HELPER_IDLE).expect("helpers");
            pool = next;
            pool.idle -= 1;
            if waited.timed_out() && pool.jobs.is_empty() {
                pool.threads -= 1;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Instant;

    /// Jobs that block until released: the first `threads - 1` run on the caller, the rest on helpers,
    /// and a caller is never held by a job beyond those.
    #[test]
    fn work_beyond_all_but_one_fuse_thread_runs_on_helpers() {
        let waits = Arc::new(Waits::new(3));
        let (release, released) = (Arc::new((Mutex::new(false), Condvar::new())), Arc::new(AtomicUsize::new(0)));
        let (started, starts) = mpsc::channel();
        let job = |n: usize| {
            let (release, released, started) = (release.clone(), released.clone(), started.clone());
            move || {
                started.send((n, std::thread::current().name().map(str::to_owned))).unwrap();
                let (lock, cv) = &*release;
                let mut go = lock.lock().unwrap();
                while !*go {
                    go = cv.wait(go).unwrap();
                }
                released.fetch_add(1, Ordering::SeqCst);
            }
        };
        // Two "FUSE threads" block in work that waits.
        let fuse: Vec<_> = (0..2)
            .map(|n| {
                let (waits, job) = (waits.clone(), job(n));
                std::thread::spawn(move || waits.run(job))
            })
            .collect();
        for _ in 0..2 {
            starts.recv_timeout(Duration::from_secs(10)).unwrap();
        }
        // The third FUSE thread hands five more to helpers and is free at once.
        let before = Instant::now();
        for n in 2..7 {
            waits.run(job(n));
        }
        assert!(before.elapsed() < Duration::from_secs(5), "the last FUSE thread was held");
        let mut helped = Vec::new();
        for _ in 2..7 {
            let (n, name) = starts.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(name.as_deref(), Some("batchfs-wait"), "job {n}");
            helped.push(n);
        }
        helped.sort();
        assert_eq!(helped, [2, 3, 4, 5, 6]);
        assert_eq!(waits.helpers().0, 5);
        *release.0.lock().unwrap() = true;
        release.1.notify_all();
        fuse.into_iter().for_each(|t| t.join().unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        while released.load(Ordering::SeqCst) < 7 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(released.load(Ordering::SeqCst), 7);
        assert_eq!(waits.inline.load(Ordering::SeqCst), 0, "every FUSE thread counted out");
        // Idle helpers take the next jobs: no new thread.
        let (done, finished) = mpsc::channel();
        for n in 0..3 {
            let done = done.clone();
            waits.helpers.clone().run(Box::new(move || done.send(n).unwrap()));
        }
        let mut got: Vec<i32> = (0..3).map(|_| finished.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        got.sort();
        assert_eq!(got, [0, 1, 2]);
        assert_eq!(waits.helpers().0, 5, "reused, not made anew");
    }

    /// A helper that cannot be started (a pids limit) while none runs: the job runs on the FUSE thread that
    /// asked, not queued for good (its reply never sent, not even EIO); a job queued behind a running
    /// helper waits for it.
    #[test]
    fn a_job_no_helper_can_be_started_for_runs_on_the_fuse_thread() {
        let mut waits = Waits::new(1);
        let refused: Spawn = |_| Err(std::io::Error::from_raw_os_error(libc::EAGAIN));
        waits.helpers = Arc::new(Helpers { spawn: refused, ..Helpers::default() });
        let (tx, rx) = mpsc::channel();
        let caller = std::thread::current().id();
        waits.run(move || tx.send(std::thread::current().id()).unwrap());
        assert_eq!(rx.recv_timeout(Duration::from_secs(2)), Ok(caller), "never run");
        assert_eq!((waits.helpers(), waits.helpers.pool.lock().unwrap().jobs.len()), ((0, 0), 0));
    }

    /// With one FUSE thread, everything that may wait goes to a helper; a job that panics neither keeps
    /// a FUSE thread counted nor ends its helper.
    #[test]
    fn one_fuse_thread_keeps_none_and_a_panicking_job_loses_nothing() {
        let waits = Waits::new(1);
        let (tx, rx) = mpsc::channel();
        waits.run(|| panic!("a job that panics"));
        let t = tx.clone();
        waits.run(move || t.send(std::thread::current().name().map(str::to_owned)).unwrap());
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap().as_deref(), Some("batchfs-wait"));
        assert_eq!(waits.inline.load(Ordering::SeqCst), 0);
        let inline = Waits::new(2);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inline.run(|| panic!("inline"))));
        assert!(result.is_err());
        assert_eq!(inline.inline.load(Ordering::SeqCst), 0, "counted out by the guard");
    }
}
