//! The supervisor and its worker (docs/DESIGN.md, "Takeover"). `batchfs mount` mounts, answers the kernel's
//! `INIT` and holds the connection's `/dev/fuse` descriptor; a worker process (the same program, started
//! with the descriptor) serves it: cache, prefetch, network. When the worker dies (a signal, a panic, the
//! OOM killer) the supervisor starts another at once on the same descriptor; the kernel keeps the
//! connection, its open files and its backing files all the while, since the supervisor holds it. Workers
//! that do not reach service (they fail to start, or die within `worker_settle` of serving: by themselves,
//! or killed, as the OOM killer kills a worker each time it takes load) are started again after growing
//! waits, and five in a row give the mount up: unmounted, the supervisor exits with the last one's reason
//! (`supervise/restarts.rs`).
//!
//! **Takeover.** The new worker does not wait for an `INIT` (the kernel sends one per connection): it
//! takes the settings `INIT` settled, the open handles and the views' state from the ledger
//! (`ledger.rs`), serves the same inode numbers, and asks the kernel to re-send the requests the dead
//! worker had read and not answered (`FUSE_NOTIFY_RESEND`, Linux 6.9). Every worker thread reads the
//! supervisor's descriptor itself, so what a dead worker read stays with the connection to be re-sent.
//! Where the kernel cannot re-send (or with `resend=off`), each worker reads its own clones of the
//! descriptor instead: the kernel fails what a dead worker's clones had read (`ECONNABORTED`) rather than
//! leave it waiting for ever.
//!
//! **Upgrades.** `batchfs mount --upgrade DIR` (or SIGHUP to the supervisor) replaces a healthy worker by
//! one of the program now installed at the path the supervisor was started from.
//!
//! **systemd.** Under a unit with `FileDescriptorStoreMax=`, the supervisor stores the descriptor and the
//! ledger with systemd (`FDSTORE=1`); a supervisor started again by systemd finds them (`LISTEN_FDS`) and
//! takes the mount over instead of mounting (`supervise/systemd.rs`).
//!
//! The supervisor starts no thread and no runtime: it waits on a signalfd and the worker's ready socket.

use crate::fuse::negotiate;
use crate::ledger::{Ledger, Settings};
use crate::plan::MountPlan;
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod restarts;
mod systemd;
mod worker;

use restarts::{Restarts, Turn};
pub use systemd::kept_by_systemd;
use systemd::{forget_with_systemd, store_with_systemd, stored_with_systemd};
use worker::Worker;

/// The environment variable that makes `batchfs mount` a worker.
pub const WORKER_ENV: &str = "BATCHFS_WORKER";
/// Where a worker finds the mountpoint, as the supervisor resolved it.
const MOUNTPOINT_ENV: &str = "BATCHFS_WORKER_MOUNTPOINT";
/// Set for a worker that runs the supervisor's own program because the installed one could not serve:
/// what `batchfs mount --upgrade` looks for in the new worker's environment to say the upgrade failed.
const FALLBACK_ENV: &str = "BATCHFS_WORKER_FALLBACK";
/// A worker's descriptors: the connection, the ledger, the dataset's description, the ready socket.
const FUSE_FD: RawFd = 3;
const LEDGER_FD: RawFd = 4;
const INFO_FD: RawFd = 5;
const READY_FD: RawFd = 6;
/// A worker that exits with this asks to be replaced (it was told to, for an upgrade).
pub const EXIT_REPLACE: i32 = 75;
/// How long a new worker may take to serve before it is given up on.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// The filesystem the supervisor mounts with: it only answers `INIT`, as a worker would have.
struct Negotiator {
    passthrough: bool,
    resend: bool,
    settled: std::sync::Arc<std::sync::Mutex<Option<Settings>>>,
}

impl fuser::Filesystem for Negotiator {
    fn init(&mut self, _req: &fuser::Request, config: &mut fuser::KernelConfig) -> std::io::Result<()> {
        let passthrough = negotiate(config, self.passthrough);
        let resend = self.resend && config.capabilities().contains(fuser::InitFlags::FUSE_HAS_RESEND);
        if self.resend && !resend {
            tracing::warn!(
                "the kernel cannot re-send requests (Linux < 6.9): a read in flight when a worker dies fails"
            );
        }
        *self.settled.lock().expect("settled") = Some(Settings { passthrough, resend });
        Ok(())
    }
}

/// What the supervisor holds: the connection (and, when it mounted, the mount itself), the ledger and
/// the dataset's description.
struct Held {
    fuse: OwnedFd,
    ledger: Ledger,
    info: File,
    /// The session that mounted (never run): dropping it unmounts.
    mounted: Option<fuser::Session<Negotiator>>,
    /// The mount's id ([`crate::sys::mount_id`]): once the mount has ended, another may be made at the
    /// same place, and it is not this supervisor's to take down.
    mount_id: Option<u64>,
}

/// Mounts `plan` (or takes over the mount systemd kept), starts the first worker, reports through `ready`
/// once it serves, and supervises until the mount ends: unmounted from outside, or SIGTERM/SIGINT here.
pub fn supervise(plan: &MountPlan, config: fuser::Config, ready: Option<&mut UnixStream>) -> Result<()> {
    let (held, adopted) = match stored_with_systemd()? {
        Some(held) => {
            tracing::info!(mountpoint = %plan.mountpoint.display(), "taking over the mount systemd kept");
            (Held { mount_id: mount_id_of(&plan.mountpoint), ..held }, true)
        }
        None => (mount(plan, config)?, false),
    };
    let signals = Signals::block()?;
    let exe = installed(std::env::current_exe().context("cannot tell which program to start workers from")?);
    // A mount taken over from systemd is without service since its last supervisor died (when, is not
    // known here: counted from now).
    let died_at = adopted.then(Instant::now);
    let mut supervisor = Supervisor {
        plan,
        held,
        signals,
        exe,
        worker: None,
        died_at,
        restarts: Restarts::new(plan.options.worker_starts, plan.options.worker_settle),
        dying: Vec::new(),
        failing: None,
    };
    // A first worker killed before it said it serves (by the OOM killer, or by hand) is replaced, as a
    // later one is, a few times; one that says why it cannot serve fails the mount.
    let mut killed = 0;
    while let Err(e) = supervisor.start_worker() {
        match e.downcast_ref::<NotServing>() {
            Some(n) if n.killed && killed < FIRST_WORKER_KILLS => {
                killed += 1;
                tracing::warn!(error = %e, "the first worker was killed before it served: starting another");
            }
            _ => return Err(e),
        }
    }
    // Ready once a worker serves.
    if let Err(e) = store_with_systemd(&supervisor.held) {
        tracing::warn!(error = %e, "cannot store the mount with systemd: a restart of this unit unmounts");
    }
    if let Some(pipe) = ready {
        let _ = pipe.write_all(b"ok");
        let _ = pipe.shutdown(std::net::Shutdown::Both);
    }
    // The checks before mounting touched much of the program (HTTP, TLS, a runtime) that the loop never
    // runs again.
    crate::sys::shed_pages();
    supervisor.run()
}

fn mount(plan: &MountPlan, config: fuser::Config) -> Result<Held> {
    let settled = std::sync::Arc::new(std::sync::Mutex::new(None));
    let negotiator =
        Negotiator { passthrough: plan.options.passthrough, resend: plan.options.resend, settled: settled.clone() };
    let session = crate::plan::mount_alone(&plan.mountpoint, || {
        fuser::Session::new(negotiator, &plan.mountpoint, &config).with_context(|| crate::plan::cannot_mount(plan))
    })?;
    let settings = settled.lock().expect("settled").context("the kernel sent no INIT")?;
    let fuse = session.as_fd().try_clone_to_owned()?;
    let ledger = Ledger::create().context("cannot make the mount's ledger")?;
    ledger.settle(settings);
    let mut info = crate::sys::memfd("batchfs-info")?;
    let kept = Kept { info: plan.info.clone(), block_bytes: plan.options.plan.block_bytes };
    info.write_all(&serde_json::to_vec(&kept)?)?;
    tracing::info!(passthrough = settings.passthrough, resend = settings.resend, "mounted; starting the worker");
    let mount_id = mount_id_of(&plan.mountpoint);
    Ok(Held { fuse, ledger, info, mounted: Some(session), mount_id })
}

struct Supervisor<'a> {
    plan: &'a MountPlan,
    held: Held,
    signals: Signals,
    exe: PathBuf,
    worker: Option<Worker>,
    /// When the last worker died (the mount is without service until the next serves).
    died_at: Option<Instant>,
    /// The workers in a row that did not reach service, and when the next may start.
    restarts: Restarts,
    /// Workers whose main thread has exited and that are not reaped yet (see [`Worker::ended`]).
    dying: Vec<std::process::Child>,
    /// Where requests are read to be answered `EIO` while no worker can serve ([`FAIL_BUFFER`] bytes).
    failing: Option<Vec<u8>>,
}

/// The path a program was started from, where Linux names it `PATH (deleted)` once the file there was
/// replaced (a package upgrade while the mount was being checked): workers start from what is installed
/// at that path now.
fn installed(exe: PathBuf) -> PathBuf {
    match exe.to_str().and_then(|s| s.strip_suffix(" (deleted)")) {
        Some(path) => PathBuf::from(path),
        None => exe,
    }
}

/// How many first workers killed before they serve a mount replaces before it fails.
const FIRST_WORKER_KILLS: u32 = 3;

/// A worker that ended before it served the mount: what it said (`error: ...`), or nothing, and how it
/// ended. `killed`: by a signal, before saying anything or its time to say it was up.
#[derive(Debug, thiserror::Error)]
struct NotServing {
    exe: String,
    why: String,
    status: std::process::ExitStatus,
    killed: bool,
}

impl std::fmt::Display for NotServing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::os::unix::process::ExitStatusExt;
        write!(f, "the worker ({}) did not serve the mount", self.exe)?;
        match (self.why.is_empty(), self.status.signal()) {
            (true, _) => write!(f, " ({})", self.status),
            // The reason it gave, alone: the supervisor's SIGKILL that ended it after ("signal: 9
            // (SIGKILL)") read as a crash. Another signal (SIGSEGV) is said.
            (false, Some(libc::SIGKILL)) => write!(f, ": {}", self.why),
            (false, _) => write!(f, ": {} ({})", self.why, self.status),
        }
    }
}

/// The errno a new worker fails with between fork and exec where its parent is not its supervisor (the
/// supervisor died meanwhile: the worker would outlive it). Only an errno reaches the parent from there
/// (an error without one arrives as `EINVAL`, "Invalid argument"), and none of the calls made there, nor
/// `execve`, fails with this one: "No such process".
const SUPERVISOR_GONE: i32 = libc::ESRCH;

/// In a new worker, between fork and exec: the supervisor's descriptors `fds` placed at [`FUSE_FD`] and
/// on, the signal mask cleared, the worker set to die with its supervisor (`PR_SET_PDEATHSIG`), and
/// refused ([`SUPERVISOR_GONE`]) where its parent is not `supervisor` already: it was gone before the
/// death signal was set, which the worker would then never get. Async-signal-safe.
///
/// # Safety
///
/// Only in a child between fork and exec: it overwrites the descriptors from [`FUSE_FD`] on.
unsafe fn before_exec(fds: [RawFd; 4], supervisor: libc::pid_t) -> std::io::Result<()> {
    // SAFETY: fcntl, dup2, sigprocmask, prctl and getppid, on descriptors this process holds open and a
    // signal set of its own; the caller is a child between fork and exec.
    unsafe {
        // Above every target first, so that no dup2 overwrites a descriptor still to be moved (these copies
        // close at exec; the targets stay open).
        let mut moved = [0; 4];
        for (i, &fd) in fds.iter().enumerate() {
            moved[i] = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10);
            if moved[i] < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        for (target, &fd) in (FUSE_FD..).zip(moved.iter()) {
            if libc::dup2(fd, target) < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        let empty = std::mem::zeroed::<libc::sigset_t>();
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        // The worker goes with its supervisor: a mount the supervisor no longer holds is gone.
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::getppid() != supervisor {
            return Err(std::io::Error::from_raw_os_error(SUPERVISOR_GONE));
        }
    }
    Ok(())
}

/// Why a worker could not be started.
#[derive(Debug, thiserror::Error)]
enum SpawnError {
    /// Its check between fork and exec ([`before_exec`]) found its parent was not this supervisor.
    #[error(
        "cannot start a worker from {exe}: its parent was not the supervisor (pid {supervisor}) by the time it \
         set itself to die with it, so it did not start (a worker must not outlive the supervisor that holds \
         its mount: the supervisor is gone, or the worker is in another PID namespace)"
    )]
    SupervisorGone { exe: PathBuf, supervisor: libc::pid_t },
    #[error("cannot start a worker from {exe}")]
    Spawn {
        exe: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl SpawnError {
    /// The error `Command::spawn` of a worker from `exe` by `supervisor` returned, said.
    fn new(exe: &Path, supervisor: libc::pid_t, source: std::io::Error) -> SpawnError {
        let exe = exe.to_owned();
        match source.raw_os_error() {
            Some(SUPERVISOR_GONE) => SpawnError::SupervisorGone { exe, supervisor },
            _ => SpawnError::Spawn { exe, source },
        }
    }
}

/// A read of the FUSE connection holds the largest request (fuser's `max_write` of 16 MiB and a page).
const FAIL_BUFFER: usize = (16 << 20) + 4096;

impl Supervisor<'_> {
    /// Starts a worker and waits until it serves (it said so on the ready socket), trying the program this
    /// supervisor runs when the installed one fails to start.
    fn start_worker(&mut self) -> Result<()> {
        let installed = self.exe.clone();
        match self.spawn(&installed, false) {
            Ok(w) => self.serving(w),
            // Replacing a worker (not mounting): the mount must not stay without one.
            Err(e) if self.died_at.is_some() => {
                tracing::error!(error = %format!("{e:#}"), exe = %installed.display(), "the installed program \
                                cannot serve the mount: starting the one this supervisor runs");
                let w = self.spawn(Path::new("/proc/self/exe"), true)?;
                self.serving(w)
            }
            Err(e) => Err(e),
        }
    }

    fn serving(&mut self, w: Worker) -> Result<()> {
        let pid = w.child.id();
        let took = self.died_at.take().map(|t| t.elapsed());
        self.held.ledger.worker_started(std::process::id(), pid, took.map(|d| d.as_micros() as u64));
        match took {
            Some(d) => tracing::warn!(pid, ms = d.as_secs_f64() * 1e3, "takeover: a new worker serves the mount"),
            None => tracing::info!(pid, "the worker serves the mount"),
        }
        self.worker = Some(w);
        Ok(())
    }

    /// Starts a worker of `exe` (`fallback`: the supervisor's own program, the installed one failed).
    fn spawn(&mut self, exe: &Path, fallback: bool) -> Result<Worker> {
        let (mut mine, theirs) = UnixStream::pair()?;
        let fds = [
            self.held.fuse.as_raw_fd(),
            self.held.ledger.file().as_raw_fd(),
            self.held.info.as_raw_fd(),
            theirs.as_raw_fd(),
        ];
        let supervisor = std::process::id() as libc::pid_t;
        let mut args = std::env::args_os();
        let mut command = std::process::Command::new(exe);
        command.arg0(args.next().unwrap_or_else(|| "batchfs".into())).args(args);
        command.env(WORKER_ENV, "1").env(MOUNTPOINT_ENV, &self.plan.mountpoint);
        if fallback {
            command.env(FALLBACK_ENV, "1");
        }
        // SAFETY: the closure runs in the child between fork and exec, as `before_exec` must.
        unsafe { command.pre_exec(move || before_exec(fds, supervisor)) };
        let child = command.spawn().map_err(|source| SpawnError::new(exe, supervisor, source))?;
        drop(theirs);
        let mut w = Worker::new(child, exe);
        // "ready" once it serves (then, on the same socket, "error: ..." if its session ends in error);
        // "error: ..." or nothing (the socket closed) if it cannot.
        mine.set_read_timeout(Some(READY_WITHIN))?;
        let mut said = Vec::new();
        let mut buf = [0u8; 512];
        let closed = loop {
            match mine.read(&mut buf) {
                Ok(0) => break true,
                Ok(n) => said.extend_from_slice(&buf[..n]),
                Err(_) => break false,
            }
            if let Some(after) = said.strip_prefix(b"ready") {
                w.said = after.to_vec();
                w.since = Instant::now();
                w.words = mine.set_nonblocking(true).is_ok().then_some(mine);
                return Ok(w);
            }
        };
        let said = String::from_utf8_lossy(&said).into_owned();
        // A worker that said why, or closed its end, is exiting: its own status says more than the SIGKILL
        // that would end it here ("the worker did not serve: ... (exit status: 1)").
        let exiting = Instant::now() + Duration::from_secs(1);
        while closed && Instant::now() < exiting && w.child.try_wait()?.is_none() {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = w.child.kill();
        let status = w.child.wait()?;
        use std::os::unix::process::ExitStatusExt;
        let killed = closed && said.is_empty() && status.signal().is_some();
        let why = said.strip_prefix("error: ").map(str::trim).unwrap_or("it exited before serving").to_owned();
        // The supervisor's own program by its path, not `/proc/self/exe`.
        let exe = match exe == Path::new("/proc/self/exe") {
            true => std::fs::read_link(exe)
                .map_or(exe.display().to_string(), |p| format!("{}, the supervisor's", p.display())),
            false => exe.display().to_string(),
        };
        Err(NotServing { exe, why, status, killed }.into())
    }

    /// Waits on signals: a worker that died is replaced, SIGHUP upgrades, SIGTERM/SIGINT unmount.
    fn run(mut self) -> Result<()> {
        loop {
            match self.signals.next()? {
                // A worker's exit is looked for at every SIGCHLD and every [`LOOK_EVERY`] besides.
                signal @ (libc::SIGCHLD | RETRY) => {
                    self.reap_dying();
                    let Some(w) = self.worker.as_mut() else {
                        if signal == RETRY && self.without_worker()? == Mount::Gone {
                            return self.unmount();
                        }
                        continue;
                    };
                    let Some(status) = w.ended()? else { continue };
                    let mut w = self.worker.take().expect("looked at above");
                    let served = w.since.elapsed();
                    self.died_at = Some(Instant::now());
                    use std::os::unix::process::ExitStatusExt;
                    if status.code() == Some(0) {
                        // Its session ended: the mount is gone (unmounted, or its connection aborted).
                        self.dying.extend(w.retire());
                        tracing::info!("the mount ended: the supervisor exits");
                        return self.unmount();
                    }
                    if status.code() == Some(EXIT_REPLACE) {
                        tracing::info!("the worker stepped down: starting the installed program");
                    } else {
                        tracing::warn!(signal = status.signal(), code = status.code(), "the worker died: taking over");
                    }
                    match self.restarts.turn(status, served) {
                        // The next later, or the mount given up.
                        Turn::Failed => {
                            let why = w.not_serving(status, self.restarts.settle());
                            self.dying.extend(w.retire());
                            self.not_served(why.into())?;
                        }
                        // The next at once: a takeover's time without service is the new worker's start.
                        turn => {
                            if turn == Turn::Served {
                                self.restarts.served();
                            }
                            self.dying.extend(w.retire());
                            if self.start_again()? == Mount::Gone {
                                return self.unmount();
                            }
                        }
                    }
                }
                libc::SIGHUP => {
                    if let Some(w) = &self.worker {
                        tracing::info!(pid = w.child.id(), "upgrade: replacing the worker");
                        // SAFETY: kill has no memory-safety preconditions.
                        unsafe { libc::kill(w.child.id() as libc::pid_t, libc::SIGTERM) };
                    }
                }
                _ => {
                    tracing::info!("signal received: unmounting");
                    return self.unmount();
                }
            }
        }
    }

    /// Reaps the workers that were still finishing when they were replaced.
    fn reap_dying(&mut self) {
        self.dying.retain_mut(|child| match child.try_wait() {
            Ok(None) => true,
            Ok(Some(status)) => {
                tracing::info!(pid = child.id(), %status, "a replaced worker has finished");
                false
            }
            Err(_) => false,
        });
    }

    /// Starts a worker. One that does not serve is counted ([`Supervisor::not_served`]): the next is tried
    /// later, or the mount is given up (`Err`, unmounted).
    fn start_again(&mut self) -> Result<Mount> {
        let Err(e) = self.start_worker() else { return Ok(Mount::There) };
        if self.fail_waiting() == Mount::Gone {
            return Ok(Mount::Gone);
        }
        self.not_served(e)?;
        Ok(Mount::There)
    }

    /// At each look while no worker serves: the next worker started once its wait is over; meanwhile, the
    /// requests waiting past `timeout` answered `EIO`, and the mount's end noticed.
    fn without_worker(&mut self) -> Result<Mount> {
        let wait = self.restarts.until_due(Instant::now());
        if wait.is_zero() {
            return self.start_again();
        }
        self.signals.retry_after(wait);
        Ok(self.fail_waiting())
    }

    /// Counts a worker that did not reach service (`why`): the next is started after a wait that grows
    /// ([`restarts`]), or, after `worker_starts` in a row, the mount is given up: unmounted,
    /// and `why` returned, for the supervisor to exit with.
    fn not_served(&mut self, why: anyhow::Error) -> Result<()> {
        let Some(wait) = self.restarts.failed(Instant::now()) else {
            let e = why.context(format!(
                "{} workers in a row did not serve the mount at {} (started again up to {:?} apart): the \
                 supervisor gives it up and unmounts it",
                self.plan.options.worker_starts,
                self.plan.mountpoint.display(),
                restarts::LONGEST_WAIT,
            ));
            tracing::error!(error = %format!("{e:#}"), "the mount is given up");
            self.take_down();
            return Err(e);
        };
        let (error, failed) = (format!("{why:#}"), self.restarts.failed_in_a_row());
        tracing::error!(%error, failed, ?wait, "no worker serves the mount: trying again");
        self.signals.retry_after(wait);
        Ok(())
    }

    /// Once the mount has been without a worker for `timeout` (no worker can start: its program gone, its
    /// `cache_dir` unusable...), the requests readers wait in are answered `EIO` at each look, as a read
    /// of an unreachable server is: no reader waits for good. The next worker to start serves what comes
    /// after. `Gone` once the mount was unmounted (`umount -l`) meanwhile: no worker's session ends to
    /// say so. Each look answers a bounded number of requests for a bounded time (`sys::fail_queued`):
    /// readers that retry at once on `EIO` once kept it from returning to the signals for good.
    fn fail_waiting(&mut self) -> Mount {
        let Some(since) = self.died_at else { return Mount::There };
        if since.elapsed() < self.plan.options.timeout {
            return Mount::There;
        }
        // What the dead worker had read and not answered goes back to the queue first (as a takeover's
        // re-send does), to be answered with the rest.
        if self.held.ledger.settings().is_some_and(|s| s.resend) {
            let _ = crate::sys::notify_resend(self.held.fuse.as_fd());
        }
        let buffer = self.failing.get_or_insert_with(|| vec![0; FAIL_BUFFER]);
        match crate::sys::fail_queued(self.held.fuse.as_fd(), buffer) {
            Ok(0) => {}
            Ok(n) => tracing::warn!(requests = n, "no worker serves the mount: its waiting requests answered EIO"),
            // The connection is gone: the mount was unmounted (or its connection aborted).
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {
                tracing::info!("the mount ended while no worker served it: the supervisor exits");
                return Mount::Gone;
            }
            Err(e) => tracing::warn!(error = %e, "cannot answer the mount's waiting requests"),
        }
        Mount::There
    }

    fn unmount(mut self) -> Result<()> {
        if let Some(mut w) = self.worker.take() {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
        self.take_down();
        Ok(())
    }

    /// Unmounts the supervisor's mount, if it is still there.
    fn take_down(&mut self) {
        // Its own mount only, if it is still there (its connection aborted): `batchfs umount` and a new
        // `batchfs mount` at the same place may both have come before this.
        let mountpoint = &self.plan.mountpoint;
        let ours = match self.held.mount_id {
            Some(id) => crate::sys::mount_id(mountpoint).ok() == Some(id),
            None => true,
        };
        if !ours {
            let now = if crate::plan::is_mountpoint(mountpoint) { "another is there now" } else { "unmounted" };
            tracing::info!(mountpoint = %mountpoint.display(), "the mount is gone ({now})");
        } else if crate::plan::is_mountpoint(mountpoint) {
            let _ = crate::sys::unmount(mountpoint, true);
        }
        // Unmounted already: the session must not try again (it would only log that it cannot).
        std::mem::forget(self.held.mounted.take());
        if let Err(e) = forget_with_systemd() {
            tracing::warn!(error = %e, "cannot drop the mount's descriptors from systemd's store");
        }
    }
}

/// "Retry now", from the signal loop's timer: a worker to start again, or one to look at.
const RETRY: i32 = 0;

/// How often the supervisor looks whether its worker exited, SIGCHLD or not: one SIGCHLD stands for any
/// number of exits, and a supervisor was once found waiting in `poll` with its killed worker a zombie,
/// unreaped, no SIGCHLD pending, and the mount without a worker (its readers waiting for good).
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// The signals the supervisor waits on, blocked and read from a signalfd.
struct Signals {
    fd: OwnedFd,
    retry: Option<Instant>,
}

impl Signals {
    fn block() -> Result<Signals> {
        // SAFETY: sigset functions write the set they are given; signalfd returns a new descriptor.
        unsafe {
            let mut set = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut set);
            for s in [libc::SIGCHLD, libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
                libc::sigaddset(&mut set, s);
            }
            if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
                bail!("cannot block signals");
            }
            let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error().into());
            }
            Ok(Signals { fd: OwnedFd::from_raw_fd(fd), retry: None })
        }
    }

    fn retry_after(&mut self, d: Duration) {
        self.retry = Some(Instant::now() + d);
    }

    /// The next signal, or [`RETRY`] when the retry timer is due or [`LOOK_EVERY`] passed without one.
    fn next(&mut self) -> Result<i32> {
        loop {
            let wait = match self.retry {
                Some(at) => at.saturating_duration_since(Instant::now()).min(LOOK_EVERY),
                None => LOOK_EVERY,
            };
            let timeout = wait.as_millis() as i32;
            let mut poll = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one pollfd, valid for the call.
            let n = unsafe { libc::poll(&mut poll, 1, timeout) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            if n == 0 {
                self.retry = None;
                return Ok(RETRY);
            }
            let mut info = std::mem::MaybeUninit::<libc::signalfd_siginfo>::uninit();
            let size = std::mem::size_of::<libc::signalfd_siginfo>();
            // SAFETY: reads at most one siginfo into memory of its size.
            let got = unsafe { libc::read(self.fd.as_raw_fd(), info.as_mut_ptr().cast(), size) };
            if got == size as isize {
                // SAFETY: the kernel wrote the whole struct.
                return Ok(unsafe { info.assume_init() }.ssi_signo as i32);
            }
        }
    }
}

/// The id of the mount at `mountpoint` (`None`, logged, where the kernel tells none: then whatever is
/// mounted there when the supervisor ends is taken for its own).
fn mount_id_of(mountpoint: &Path) -> Option<u64> {
    crate::sys::mount_id(mountpoint)
        .inspect_err(|e| tracing::warn!(error = %e, "cannot tell the mount's id: it is taken down by its path"))
        .ok()
}

/// Whether a supervisor's mount is still there, as its FUSE connection says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mount {
    There,
    /// Unmounted, or its connection aborted: the supervisor has nothing left to serve.
    Gone,
}

/// What a supervisor keeps for its workers beside the mount (in a memory file, with systemd too): the
/// dataset's description, and the `block_bytes` the mount planned with. A worker parses its options from
/// the command line again, where `shuffle=blocks` without `block_bytes` means "the first server's
/// default": resolved again by each worker, it was another server's where the first was down, or each
/// server's own (a worker of a mount of replicas with tiers of other sizes read other epochs than the
/// mount listed, and its replica's bodies failed their checksums). A description kept by a supervisor of
/// a release before has no `block_bytes`.
#[derive(serde::Serialize, serde::Deserialize)]
struct Kept {
    #[serde(flatten)]
    info: batchfs::api::DatasetInfo,
    #[serde(default)]
    block_bytes: u64,
}

/// A worker's inheritance, when this process is one (started by a supervisor).
pub struct WorkerStart {
    pub fuse: OwnedFd,
    pub ledger: std::sync::Arc<Ledger>,
    pub settings: Settings,
    pub info: batchfs::api::DatasetInfo,
    /// The `block_bytes` the mount planned with (0: none, or a supervisor of a release before).
    pub block_bytes: u64,
    pub mountpoint: PathBuf,
    ready: UnixStream,
}

impl WorkerStart {
    /// The descriptors and settings a supervisor handed this process, if it started it as a worker.
    pub fn from_env() -> Result<Option<WorkerStart>> {
        if std::env::var_os(WORKER_ENV).is_none() {
            return Ok(None);
        }
        std::env::remove_var(WORKER_ENV);
        let mountpoint = PathBuf::from(std::env::var_os(MOUNTPOINT_ENV).context("a worker without a mountpoint")?);
        std::env::remove_var(MOUNTPOINT_ENV);
        // SAFETY: the supervisor placed these descriptors for this process, which owns them from here.
        let (fuse, ledger, info, ready) = unsafe {
            (
                OwnedFd::from_raw_fd(FUSE_FD),
                File::from_raw_fd(LEDGER_FD),
                File::from_raw_fd(INFO_FD),
                UnixStream::from_raw_fd(READY_FD),
            )
        };
        for fd in [FUSE_FD, LEDGER_FD, INFO_FD, READY_FD] {
            // SAFETY: F_SETFD on a descriptor this process owns: not inherited by what it may run.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        let ledger = std::sync::Arc::new(Ledger::open(ledger)?);
        let settings = ledger.settings().context("the mount's ledger holds no settings")?;
        let mut text = Vec::new();
        let mut info = info;
        std::io::Seek::seek(&mut info, std::io::SeekFrom::Start(0))?;
        info.read_to_end(&mut text)?;
        let Kept { info, block_bytes } =
            serde_json::from_slice(&text).context("the dataset's description the supervisor kept")?;
        Ok(Some(WorkerStart { fuse, ledger, settings, info, block_bytes, mountpoint, ready }))
    }

    /// Tells the supervisor this worker serves the mount; what it returns tells why it stopped, if it does.
    pub fn ready(mut self) -> Serving {
        let _ = self.ready.write_all(b"ready");
        Serving(self.ready)
    }

    /// Tells the supervisor why this worker cannot serve.
    pub fn failed(mut self, e: &anyhow::Error) {
        let _ = write!(self.ready, "error: {e:#}");
    }
}

/// A worker's ready socket once it serves: where it tells its supervisor why its session ended in error
/// (a FUSE thread it could not start: the supervisor names it when it gives the mount up).
pub struct Serving(UnixStream);

impl Serving {
    /// Tells the supervisor why this worker stops serving.
    pub fn stopped(mut self, e: &anyhow::Error) {
        let _ = write!(self.0, "error: {e:#}");
    }
}

/// `batchfs mount --upgrade DIR`: has the supervisor of the mount at `dir` replace its worker by the
/// program now installed, and waits until the new worker serves.
pub fn upgrade(dir: &Path) -> Result<()> {
    let read = || -> Result<crate::stats::StatsSnapshot> {
        let path = dir.join(crate::fs::META_NAME).join("stats");
        let text =
            std::fs::read(&path).with_context(|| format!("cannot read {} (a batchfs mount?)", path.display()))?;
        serde_json::from_slice(&text).context("malformed stats")
    };
    let before = read()?;
    if before.supervisor_pid == 0 {
        bail!("{} is served by one process (supervise=false): remount it to upgrade", dir.display());
    }
    // SAFETY: kill has no memory-safety preconditions.
    if unsafe { libc::kill(before.supervisor_pid as libc::pid_t, libc::SIGHUP) } != 0 {
        bail!("cannot signal the supervisor (pid {}): {}", before.supervisor_pid, std::io::Error::last_os_error());
    }
    let deadline = Instant::now() + READY_WITHIN;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        if let Ok(now) = read() {
            if now.worker_pid != before.worker_pid && now.worker_restarts > before.worker_restarts {
                // A new program that cannot serve has the supervisor start the one it runs: the mount is
                // served, but not upgraded. Its worker says so in its environment; a supervisor of a release
                // before that, only where the install replaced its program (a program renamed aside, not
                // replaced, was taken for the upgrade's).
                let exe = std::fs::read_link(format!("/proc/{}/exe", now.worker_pid)).unwrap_or_default();
                let environ = std::fs::read(format!("/proc/{}/environ", now.worker_pid)).unwrap_or_default();
                let fallback = environ.split(|&b| b == 0).any(|v| v == format!("{FALLBACK_ENV}=1").as_bytes());
                if fallback || exe.to_string_lossy().ends_with(" (deleted)") {
                    bail!(
                        "the program installed now cannot serve {}: worker {} runs the one it replaced ({}); see \
                         the mount's log",
                        dir.display(),
                        now.worker_pid,
                        exe.display()
                    );
                }
                println!(
                    "upgraded {}: worker {} replaced by {} ({:.1} ms without service)",
                    dir.display(),
                    before.worker_pid,
                    now.worker_pid,
                    now.last_takeover_us as f64 / 1e3
                );
                return Ok(());
            }
        }
    }
    bail!("the worker of {} was not replaced within {READY_WITHIN:?} (see the mount's log)", dir.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_start_from_the_path_installed_even_once_the_file_there_was_replaced() {
        assert_eq!(installed("/usr/bin/batchfs (deleted)".into()), Path::new("/usr/bin/batchfs"));
        assert_eq!(installed("/usr/bin/batchfs".into()), Path::new("/usr/bin/batchfs"));
    }

    /// A new worker whose parent is not its supervisor (gone between fork and exec) does not start, and
    /// the error says so. Its check failed with an error without an errno, which std hands the parent as
    /// `EINVAL`: "cannot start a worker from ...: Invalid argument (os error 22)".
    #[test]
    fn a_worker_whose_supervisor_is_gone_before_it_runs_says_so() {
        use std::os::unix::process::CommandExt;
        let null = || File::open("/dev/null").unwrap();
        let files = [null(), null(), null(), null()];
        let fds = files.each_ref().map(|f| f.as_raw_fd());
        let spawn = |supervisor: libc::pid_t| {
            let mut command = std::process::Command::new("true");
            // SAFETY: the closure runs in the child between fork and exec, as `before_exec` must.
            unsafe { command.pre_exec(move || before_exec(fds, supervisor)) };
            command.spawn().map_err(|e| SpawnError::new(Path::new("true"), supervisor, e))
        };
        let mut started = spawn(std::process::id() as libc::pid_t).expect("its parent is its supervisor");
        assert!(started.wait().unwrap().success());
        // No process has this id (pid_max is at most 2^22): the child's parent is not that supervisor.
        let e = spawn(libc::pid_t::MAX).expect_err("a worker without its supervisor must not start");
        assert!(matches!(e, SpawnError::SupervisorGone { .. }), "{e:?}");
        let said = format!("{:#}", anyhow::Error::new(e));
        assert!(said.contains("its parent was not the supervisor") && !said.contains("Invalid argument"), "{said}");
    }

    /// The supervisor's wait ends every [`LOOK_EVERY`] with no signal at all, so a worker whose exit no
    /// SIGCHLD announced is still found and replaced; a retry due sooner ends it sooner.
    #[test]
    fn the_supervisor_looks_at_its_worker_without_a_signal() {
        // Blocks the four signals for this test's thread only, and reads them from its own signalfd.
        // (Another test's child may send this process a SIGCHLD meanwhile: such a wake is not the one
        // looked for.)
        let mut signals = Signals::block().unwrap();
        let next_retry = |signals: &mut Signals| {
            let started = Instant::now();
            while signals.next().unwrap() != RETRY {}
            started.elapsed()
        };
        let waited = next_retry(&mut signals);
        assert!(waited >= LOOK_EVERY - Duration::from_millis(10), "woke after {waited:?}");
        assert!(waited < LOOK_EVERY * 3, "woke after {waited:?}");
        signals.retry_after(Duration::from_millis(50));
        let waited = next_retry(&mut signals);
        assert!(waited < LOOK_EVERY / 2, "the retry waited {waited:?}");
    }
}
