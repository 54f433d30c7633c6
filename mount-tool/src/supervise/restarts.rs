//! When the supervisor starts its next worker (docs/SEMANTICS.md, "When the daemon dies"). A worker that
//! served the mount for `worker_settle` (10 s unless told) and died is replaced at once: a takeover's time
//! without service is the new worker's start alone (6-7 ms, docs/BENCHMARKS.md). A worker that did not
//! reach service (it failed to start, or died within `worker_settle` of saying it serves, whatever ended
//! it: a FUSE thread it could not start under a pids limit, options it refuses, the OOM killer as soon as
//! it took load) is followed by a wait that doubles from [`FIRST_WAIT`] up to [`LONGEST_WAIT`]; after
//! `worker_starts` ([`GIVE_UP_AFTER`] unless told) such workers in a row the supervisor gives the mount up
//! (it unmounts and exits non-zero, with the last one's reason) rather than start failing workers for good
//! (`worker_starts=0`: it never does).
//!
//! A SIGKILL soon after serving counts as a failure too: it is what the OOM killer sends, and a worker
//! that the OOM killer kills each time it comes up was otherwise replaced at once, for good, in a tight
//! loop. The count of failures in a row goes back to 0 only once a worker has served for
//! `worker_settle`. A worker that steps down for an upgrade before then ([`super::EXIT_REPLACE`], asked
//! by its supervisor) neither counts nor resets it, and its successor starts at once.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

/// The wait after the first worker in a row that did not reach service; each one after doubles it.
pub(super) const FIRST_WAIT: Duration = Duration::from_secs(1);
/// The longest wait between two workers that do not reach service.
pub(super) const LONGEST_WAIT: Duration = Duration::from_secs(8);
/// Workers in a row that do not reach service before the supervisor gives the mount up, by default
/// (`worker_starts`; about 15 s of waits: 1, 2, 4 and 8 s).
#[cfg(test)]
pub(super) const GIVE_UP_AFTER: u64 = 5;

/// How a worker's turn ended, for the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Turn {
    /// It served for `worker_settle` or more: the failures before it are forgotten.
    Served,
    /// Stepped down ([`super::EXIT_REPLACE`]) before that: asked to by its supervisor (an upgrade), not a
    /// failure of its own.
    Ended,
    /// It did not reach service: it ended by itself, or was killed (SIGKILL included: the OOM killer's).
    Failed,
}

/// The supervisor's account of the workers that did not reach service.
#[derive(Debug, Default)]
pub(super) struct Restarts {
    /// Workers in a row that did not reach service.
    failed: u64,
    /// How many of them give the mount up (0: none).
    give_up_after: u64,
    /// How long a worker must serve to count as having reached service (`worker_settle`).
    settle: Duration,
    /// When the next worker may start (none: at once).
    due: Option<Instant>,
}

impl Restarts {
    /// An account that gives the mount up after `give_up_after` workers in a row that do not reach
    /// service (0: never), where reaching it is serving for `settle`.
    pub(super) fn new(give_up_after: u64, settle: Duration) -> Self {
        Restarts { give_up_after, settle, ..Restarts::default() }
    }

    /// How a worker that said it serves ended, `served` after it said so (exit 0, the mount's end, is the
    /// caller's).
    pub(super) fn turn(&self, status: ExitStatus, served: Duration) -> Turn {
        if served >= self.settle {
            Turn::Served
        } else if status.code() == Some(super::EXIT_REPLACE) {
            Turn::Ended
        } else {
            Turn::Failed
        }
    }

    /// How long a worker must serve to count as having reached service.
    pub(super) fn settle(&self) -> Duration {
        self.settle
    }

    /// A worker served for `worker_settle`: the failures before it are forgotten.
    pub(super) fn served(&mut self) {
        (self.failed, self.due) = (0, None);
    }

    /// Counts a worker that did not reach service (at `now`): the wait before the next, or `None` where
    /// the mount is to be given up.
    pub(super) fn failed(&mut self, now: Instant) -> Option<Duration> {
        self.failed += 1;
        if self.give_up_after > 0 && self.failed >= self.give_up_after {
            return None;
        }
        let wait = wait_after(self.failed);
        self.due = Some(now + wait);
        Some(wait)
    }

    /// How long until the next worker may start (zero: now).
    pub(super) fn until_due(&self, now: Instant) -> Duration {
        self.due.map_or(Duration::ZERO, |at| at.saturating_duration_since(now))
    }

    /// Workers in a row that did not reach service.
    pub(super) fn failed_in_a_row(&self) -> u64 {
        self.failed
    }
}

/// The wait after `failed` workers in a row did not reach service: [`FIRST_WAIT`], doubled for each one
/// after the first, at most [`LONGEST_WAIT`].
fn wait_after(failed: u64) -> Duration {
    FIRST_WAIT.saturating_mul(1 << failed.saturating_sub(1).min(16)).min(LONGEST_WAIT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    /// How long a worker must serve to count as having reached service, by default (`worker_settle`, 10 s:
    /// systemd's `StartLimitIntervalSec=`, within which its `StartLimitBurst=` of 5 starts fail a unit).
    fn default_settle() -> Duration {
        crate::options::MountOptions::default().worker_settle
    }

    /// Waits of 1, 2, 4 and 8 s after the first four workers in a row that do not reach service; the
    /// fifth gives the mount up.
    #[test]
    fn the_waits_double_up_to_the_longest_and_the_fifth_failure_gives_up() {
        let (mut r, now) = (Restarts::new(GIVE_UP_AFTER, default_settle()), Instant::now());
        let waits: Vec<_> = (0..GIVE_UP_AFTER).map(|_| r.failed(now)).collect();
        let s = Duration::from_secs;
        assert_eq!(waits, [Some(s(1)), Some(s(2)), Some(s(4)), Some(s(8)), None]);
        assert_eq!(wait_after(40), LONGEST_WAIT, "no overflow, however many");
        let mut never = Restarts::new(0, default_settle());
        assert!((0..100).all(|_| never.failed(now).is_some()), "worker_starts=0: never given up");
    }

    /// The next worker is due once the wait is over; a worker that served clears the count and the wait.
    #[test]
    fn a_worker_that_served_is_followed_at_once_and_the_count_starts_again() {
        let (mut r, now) = (Restarts::new(GIVE_UP_AFTER, default_settle()), Instant::now());
        assert_eq!(r.until_due(now), Duration::ZERO, "nothing failed: at once");
        assert_eq!(r.failed(now), Some(FIRST_WAIT));
        assert_eq!(r.until_due(now), FIRST_WAIT);
        assert_eq!(r.until_due(now + FIRST_WAIT * 2), Duration::ZERO);
        assert_eq!(r.failed(now), Some(FIRST_WAIT * 2), "the second in a row");
        r.served();
        assert_eq!((r.failed_in_a_row(), r.until_due(now)), (0, Duration::ZERO));
        assert_eq!(r.failed(now), Some(FIRST_WAIT), "counted afresh");
    }

    /// A worker that ends within `worker_settle` of serving did not reach service, however it ended:
    /// SIGKILL too, the OOM killer's signal (such a worker was taken for one killed from outside and
    /// replaced at once, for good: a worker that the OOM killer kills as it comes up looped so). Only a
    /// step down, which its supervisor asked for, is not a failure.
    #[test]
    fn a_worker_that_ends_before_it_served_for_worker_settle_failed_even_killed() {
        let settle = default_settle();
        assert_eq!(settle, Duration::from_secs(10));
        let r = Restarts::new(GIVE_UP_AFTER, settle);
        let short = settle / 10;
        let (exited, crashed) = (ExitStatus::from_raw(1 << 8), ExitStatus::from_raw(libc::SIGSEGV));
        let (killed, stepped_down) =
            (ExitStatus::from_raw(libc::SIGKILL), ExitStatus::from_raw(super::super::EXIT_REPLACE << 8));
        assert_eq!(r.turn(exited, short), Turn::Failed);
        assert_eq!(r.turn(crashed, short), Turn::Failed);
        assert_eq!(r.turn(killed, short), Turn::Failed, "the OOM killer's SIGKILL as the worker comes up");
        assert_eq!(r.turn(stepped_down, short), Turn::Ended);
        assert_eq!(r.turn(exited, settle), Turn::Served);
        assert_eq!(r.turn(crashed, settle * 60), Turn::Served);
        assert_eq!(r.turn(killed, settle), Turn::Served, "a takeover: replaced at once");
        // As told: `worker_settle=2s`, and `0`, where every worker that said it serves has served.
        let (two, zero) = (Restarts::new(5, Duration::from_secs(2)), Restarts::new(5, Duration::ZERO));
        assert_eq!(two.turn(killed, Duration::from_millis(1999)), Turn::Failed);
        assert_eq!(two.turn(killed, Duration::from_secs(2)), Turn::Served);
        assert_eq!(zero.turn(killed, Duration::ZERO), Turn::Served);
    }
}
