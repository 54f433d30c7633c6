//! A worker process as its supervisor sees it: started, then serving, then ended, possibly before it can
//! be reaped (its main thread gone while a thread of it waits in the kernel), and let go; and, where it
//! stopped soon after it said it serves, why.

use super::NotServing;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub(super) struct Worker {
    pub(super) child: std::process::Child,
    /// The program it runs.
    exe: PathBuf,
    /// When it started, then when it said it serves.
    pub(super) since: Instant,
    /// When its main thread was first found gone, the process not reaped yet.
    leader_gone: Option<Instant>,
    /// Its ready socket once it serves (non-blocking), where it says why its session ended in error.
    pub(super) words: Option<UnixStream>,
    /// What it said after `ready`, read so far.
    pub(super) said: Vec<u8>,
}

/// How long a worker's main thread is gone, its process not reaped, before the worker counts as ended: its
/// other threads take microseconds to die (SIGCHLD comes once they have), unless one cannot.
const LEADER_GONE_FOR: Duration = Duration::from_millis(100);

impl Worker {
    pub(super) fn new(child: std::process::Child, exe: &Path) -> Worker {
        Worker { child, exe: exe.to_owned(), since: Instant::now(), leader_gone: None, words: None, said: Vec::new() }
    }

    /// Why it stopped, as it said once it served (`error: ...`): empty if it said nothing.
    fn last_words(&mut self) -> String {
        let mut buf = [0u8; 512];
        while let Some(socket) = self.words.as_mut().filter(|_| self.said.len() < 4096) {
            match socket.read(&mut buf) {
                Ok(n @ 1..) => self.said.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
        let said = String::from_utf8_lossy(&self.said);
        said.strip_prefix("error: ").map(|why| why.trim().to_owned()).unwrap_or_default()
    }

    /// Why a worker that said it serves ended before it served for `settle` (`worker_settle`).
    pub(super) fn not_serving(&mut self, status: std::process::ExitStatus, settle: Duration) -> NotServing {
        use std::os::unix::process::ExitStatusExt;
        let ms = self.since.elapsed().as_millis();
        let why = match self.last_words() {
            // Said, since its status is not (a SIGKILL is taken for the supervisor's own).
            why if why.is_empty() && status.signal() == Some(libc::SIGKILL) => format!(
                "it was killed (SIGKILL: the OOM killer?) {ms} ms after it said it serves, within worker_settle \
                 ({settle:?})"
            ),
            why if why.is_empty() => format!("it stopped {ms} ms after it said it serves"),
            why => why,
        };
        NotServing { exe: self.exe.display().to_string(), why, status, killed: false }
    }

    /// How the worker ended, once it has: reaped, or its main thread gone for [`LEADER_GONE_FOR`] while a
    /// thread of it still cannot die. A worker killed while one of its threads wrote a notification to the
    /// kernel (an inode's pages to drop) stays unreaped until that write returns, and the write waits on a
    /// page locked by a read only a new worker can answer: waiting to reap such a worker would leave the
    /// mount without one for good.
    pub(super) fn ended(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(Some(status));
        }
        let Some(status) = leader_exited(self.child.id()) else { return Ok(None) };
        let since = *self.leader_gone.get_or_insert_with(Instant::now);
        Ok((since.elapsed() >= LEADER_GONE_FOR).then_some(status))
    }

    /// Lets an ended worker go: its process, killed, where it is not reaped yet (to be reaped later).
    /// Whatever ended its main thread, none of its threads serves beside the next worker: each dies as it
    /// leaves the kernel.
    pub(super) fn retire(mut self) -> Option<std::process::Child> {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return None;
        }
        let pid = self.child.id();
        tracing::warn!(pid, "the worker's main thread is gone and a thread of it still finishes: taking over");
        let _ = self.child.kill();
        Some(self.child)
    }
}

/// The wait status of a process whose main thread has exited (a zombie while other threads of it finish),
/// from `/proc/PID/stat`; `None` while it runs, or when it cannot be read.
fn leader_exited(pid: u32) -> Option<std::process::ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    // Field 3 is the state; field 52 the exit code in waitpid's form (Linux 3.5).
    let stat = crate::sys::stat_from_state(pid)?;
    let mut fields = stat.split_whitespace();
    match fields.next() {
        Some("Z" | "X") => Some(std::process::ExitStatus::from_raw(fields.nth(48)?.parse().ok()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `look` finds, looking every 10 ms; fails with `why` after 20 s of nothing.
    fn within_20s<T>(why: &str, mut look: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(found) = look() {
                return found;
            }
            assert!(Instant::now() < deadline, "{why}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A worker whose main thread has exited while another thread of it still runs has ended, with its
    /// status, though it cannot be reaped yet. A killed worker is in that state while one of its threads
    /// waits in the kernel on a read only the next worker can answer: the takeover test once hung there,
    /// its supervisor waiting to reap the worker before starting another.
    #[test]
    fn a_worker_whose_main_thread_is_gone_has_ended_before_it_can_be_reaped() {
        // The main thread leaves by the thread's own exit (not the process's), after starting a thread
        // that sleeps on.
        let script = "import ctypes, platform, threading, time\n\
                      threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n\
                      print('started', flush=True)\n\
                      ctypes.CDLL(None).syscall({'x86_64': 60, 'aarch64': 93}[platform.machine()], 7)\n";
        let mut child = std::process::Command::new("python3")
            .args(["-c", script])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 runs");
        let mut said = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut said).unwrap();
        assert_eq!(said.trim(), "started");
        let mut w = Worker::new(child, Path::new("python3"));
        let status = within_20s("the worker's main thread was not found gone", || w.ended().unwrap());
        assert_eq!(status.code(), Some(7), "{status}");
        // Not at the first look that found the main thread gone: other threads may be a moment from dying.
        assert!(w.leader_gone.is_some_and(|t| t.elapsed() >= LEADER_GONE_FOR));
        // Not reaped: what the supervisor waited for before.
        assert!(w.child.try_wait().unwrap().is_none(), "the whole process exited: the test shows nothing");
        // Let go, its thread left sleeping is killed: the process is reaped soon, not when the thread wakes.
        let mut child = w.retire().expect("not reaped yet");
        let reaped = within_20s("the retired worker's threads lived on", || child.try_wait().unwrap());
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(reaped.signal(), Some(libc::SIGKILL), "{reaped}");
        assert_eq!(leader_exited(child.id()), None, "a reaped process has no state");
    }
}
