//! When the supervisor starts its next worker (docs/SEMANTICS.md, "When the daemon dies"). A worker that
//! served the mount and died is replaced at once: a takeover's time without service is the new worker's
//! start alone (6-7 ms, docs/BENCHMARKS.md). A worker that did not reach service (it failed to start, or
//! ended by itself within [`SERVED_FOR`] of saying it serves: a FUSE thread it could not start under a
//! pids limit, options it refuses) is followed by a wait that doubles from [`FIRST_WAIT`] up to
//! [`LONGEST_WAIT`]; after `worker_starts` ([`GIVE_UP_AFTER`] unless told) such workers in a row the
//! supervisor gives the mount up (it unmounts and exits non-zero, with the last one's reason) rather than
//! start failing workers for good (`worker_starts=0`: it never does).
//!
//! The count of failures in a row goes back to 0 only once a worker has served for [`SERVED_FOR`]. A
//! worker killed from outside (SIGKILL: the OOM killer, by hand) or stepping down for an upgrade before
//! then neither counts nor resets it, and its successor starts at once.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

/// How long a worker must serve to count as having reached service.
pub(super) const SERVED_FOR: Duration = Duration::from_secs(1);
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
    /// It served for [`SERVED_FOR`] or more: the failures before it are forgotten.
    Served,
    /// Killed by SIGKILL, or stepped down ([`super::EXIT_REPLACE`]), before that: from outside, not a
    /// failure of its own.
    Ended,
    /// It did not reach service.
    Failed,
}

/// How a worker that said it serves ended, `served` after it said so (exit 0, the mount's end, is the
/// caller's).
pub(super) fn turn(status: ExitStatus, served: Duration) -> Turn {
    use std::os::unix::process::ExitStatusExt;
    if served >= SERVED_FOR {
        Turn::Served
    } else if status.signal() == Some(libc::SIGKILL) || status.code() == Some(super::EXIT_REPLACE) {
        Turn::Ended
    } else {
        Turn::Failed
    }
}

/// The supervisor's account of the workers that did not reach service.
#[derive(Debug, Default)]
pub(super) struct Restarts {
    /// Workers in a row that did not reach service.
    failed: u64,
    /// How many of them give the mount up (0: none).
    give_up_after: u64,
    /// When the next worker may start (none: at once).
    due: Option<Instant>,
}

impl Restarts {
    /// An account that gives the mount up after `give_up_after` workers in a row that do not reach
    /// service (0: never).
    pub(super) fn giving_up_after(give_up_after: u64) -> Self {
        Restarts { give_up_after, ..Restarts::default() }
    }

    /// A worker served for [`SERVED_FOR`]: the failures before it are forgotten.
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

    /// Waits of 1, 2, 4 and 8 s after the first four workers in a row that do not reach service; the
    /// fifth gives the mount up.
    #[test]
    fn the_waits_double_up_to_the_longest_and_the_fifth_failure_gives_up() {
        let (mut r, now) = (Restarts::giving_up_after(GIVE_UP_AFTER), Instant::now());
        let waits: Vec<_> = (0..GIVE_UP_AFTER).map(|_| r.failed(now)).collect();
        let s = Duration::from_secs;
        assert_eq!(waits, [Some(s(1)), Some(s(2)), Some(s(4)), Some(s(8)), None]);
        assert_eq!(wait_after(40), LONGEST_WAIT, "no overflow, however many");
        let mut never = Restarts::giving_up_after(0);
        assert!((0..100).all(|_| never.failed(now).is_some()), "worker_starts=0: never given up");
    }

    /// The next worker is due once the wait is over; a worker that served clears the count and the wait.
    #[test]
    fn a_worker_that_served_is_followed_at_once_and_the_count_starts_again() {
        let (mut r, now) = (Restarts::giving_up_after(GIVE_UP_AFTER), Instant::now());
        assert_eq!(r.until_due(now), Duration::ZERO, "nothing failed: at once");
        assert_eq!(r.failed(now), Some(FIRST_WAIT));
        assert_eq!(r.until_due(now), FIRST_WAIT);
        assert_eq!(r.until_due(now + FIRST_WAIT * 2), Duration::ZERO);
        assert_eq!(r.failed(now), Some(FIRST_WAIT * 2), "the second in a row");
        r.served();
        assert_eq!((r.failed_in_a_row(), r.until_due(now)), (0, Duration::ZERO));
        assert_eq!(r.failed(now), Some(FIRST_WAIT), "counted afresh");
    }

    #[test]
    fn a_worker_that_ends_by_itself_before_it_served_for_a_second_failed() {
        let short = SERVED_FOR / 10;
        let (exited, crashed) = (ExitStatus::from_raw(1 << 8), ExitStatus::from_raw(libc::SIGSEGV));
        assert_eq!(turn(exited, short), Turn::Failed);
        assert_eq!(turn(crashed, short), Turn::Failed);
        assert_eq!(turn(ExitStatus::from_raw(libc::SIGKILL), short), Turn::Ended);
        assert_eq!(turn(ExitStatus::from_raw(super::super::EXIT_REPLACE << 8), short), Turn::Ended);
        assert_eq!(turn(exited, SERVED_FOR), Turn::Served);
        assert_eq!(turn(crashed, SERVED_FOR * 60), Turn::Served);
    }
}
