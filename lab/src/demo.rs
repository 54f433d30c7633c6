//! `batchfs-lab demo`: the README's first command. Generates a sample dataset, starts `batchfs-server` on
//! loopback, mounts it, reads one epoch with several reader threads as a loader would (each reading every
//! k-th batch file), checks every file against the manifest's CRC32C, prints a result table, unmounts and
//! cleans up.
//!
//! The server is a child process that never outlives the demo: killed when `run` returns, by the thread
//! that takes SIGINT and SIGTERM (which also unmounts and removes the temporary directory), and, were the
//! demo killed outright, by the kernel (`PR_SET_PDEATHSIG`, set as the mount's supervisor sets it on its
//! workers: a demo gone before the child set it is seen by `getppid`, and the child does not start).
//! The signal thread kills the server through the one `Child` that reaps it, under one lock, so a signal
//! after the server was reaped (the thread outlives `run`) is sent to no process: its pid may be another's
//! by then. Its log is kept in the temporary directory and quoted should it exit before serving.

use anyhow::{bail, Context, Result};
use batchfs::demo::{SampleArgs, Table, Tally};
use batchfs::encode::BatchFormat;
use batchfs::gen;
use batchfs_mount::options::MountOptions;
use clap::Args;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub sample: SampleArgs,
    /// Reader threads (reader r reads batch files r, r+k, r+2k...), at least 1.
    #[arg(long, default_value_t = 4, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub readers: usize,
    /// Batches prefetched ahead of each reader.
    #[arg(long, default_value_t = 16)]
    pub prefetch: usize,
    /// The batchfs-server binary [default: next to this binary, else on PATH].
    #[arg(long, value_name = "PATH")]
    pub server: Option<PathBuf>,
}

/// The server child (killed and waited for on drop), and where its log goes. The child is shared with the
/// signal thread ([`stop_signals::clean_up_on`]): killed or reaped only under its lock.
struct ServerProcess {
    child: Arc<Mutex<Child>>,
    program: PathBuf,
    log: PathBuf,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let mut child = self.child.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Kills the server unless it was reaped (its pid may be another process's now): whether it was signalled.
/// `std`'s `Child` knows it reaped the child, and the lock keeps it from being reaped meanwhile.
fn kill_unless_reaped(child: &Mutex<Child>) -> bool {
    let mut child = child.lock().unwrap_or_else(PoisonError::into_inner);
    matches!(child.try_wait(), Ok(None)) && child.kill().is_ok()
}

/// Between fork and exec: the child gets `signal` when the thread that forked it ends (`PR_SET_PDEATHSIG`),
/// and does not start where `parent` is gone already (its parent is then another process, which would
/// never signal it: the check the mount's supervisor makes on its workers; `ESRCH`). Async-signal-safe.
fn die_with_parent(parent: libc::pid_t, signal: libc::c_int) -> std::io::Result<()> {
    // SAFETY: prctl and getppid take and return plain integers.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, signal) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Only an errno reaches the parent from here: ESRCH, "no such process".
        if libc::getppid() != parent {
            return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        }
    }
    Ok(())
}

impl ServerProcess {
    /// Starts `program` serving `data` on `port`, logging to `log`; it gets SIGTERM when the thread that
    /// started it (this one) ends, so a demo killed outright leaves no server behind.
    fn start(program: &Path, port: u16, data: &Path, log: PathBuf) -> Result<ServerProcess> {
        let stderr = std::fs::File::create(&log)?;
        let mut command = Command::new(program);
        command
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--dataset",
                &format!("sample={}", data.display()),
            ])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(stderr);
        Self::spawn(command, program, log)
    }

    /// Spawns `command` as the server child: its signal mask cleared, and gone with the demo
    /// ([`die_with_parent`]).
    fn spawn(mut command: Command, program: &Path, log: PathBuf) -> Result<ServerProcess> {
        use std::os::unix::process::CommandExt;
        let demo = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the child between fork and exec and makes async-signal-safe calls only
        // (sigemptyset, sigprocmask, prctl, getppid), on a set local to it. The child would inherit the mask
        // that holds SIGINT and SIGTERM for the demo's signal thread (`stop_signals`): it is cleared, or the
        // server could not be stopped.
        unsafe {
            command.pre_exec(move || {
                let mut none: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut none);
                match libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut()) {
                    0 => {}
                    _ => return Err(std::io::Error::last_os_error()),
                }
                die_with_parent(demo, libc::SIGTERM)
            });
        }
        let child = command.spawn().with_context(|| format!("cannot start {}", program.display()))?;
        Ok(ServerProcess { child: Arc::new(Mutex::new(child)), program: program.to_owned(), log })
    }

    /// An error if the server has exited: its status and what it printed.
    fn check_running(&mut self) -> Result<()> {
        let status = self.child.lock().unwrap_or_else(PoisonError::into_inner).try_wait()?;
        let Some(status) = status else { return Ok(()) };
        let printed = std::fs::read_to_string(&self.log).unwrap_or_default();
        let printed = match printed.trim() {
            "" => "it printed nothing".to_owned(),
            text => text.to_owned(),
        };
        bail!("{} exited ({status}) before serving the demo: {printed}", self.program.display())
    }
}

/// Waits for the server to serve the sample dataset with `options`, up to `deadline`: only a server not
/// answering yet is waited for. A server that exited, or one that refuses the options, the dataset or the
/// mountpoint, ends the wait at once (each was waited on for a minute, in silence).
fn wait_for_plan(
    server: &mut ServerProcess,
    url: &str,
    mountpoint: &Path,
    options: &MountOptions,
    deadline: Instant,
) -> Result<batchfs_mount::plan::MountPlan> {
    use batchfs_mount::plan::Refused;
    loop {
        server.check_running()?;
        match batchfs_mount::plan::plan(url, mountpoint, options.clone()) {
            Ok(p) => return Ok(p),
            Err(e) if !e.chain().any(|c| matches!(c.downcast_ref(), Some(Refused::Unreachable { .. }))) => {
                // The server may have refused because it is going: its own words say more.
                std::thread::sleep(Duration::from_millis(50));
                server.check_running()?;
                return Err(e.context("the server refused the demo"));
            }
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(error = %e, "waiting for the server");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e.context("the server did not come up")),
        }
    }
}

/// SIGINT and SIGTERM, taken by one thread (`sigwait`) rather than by whichever thread they land on.
mod stop_signals {
    use std::path::PathBuf;
    use std::process::Child;
    use std::sync::{Arc, Mutex};

    /// Blocks SIGINT and SIGTERM in this thread and in the threads it starts from now on, for
    /// [`clean_up_on`] to take (the server child starts with them unblocked again).
    pub fn block() -> std::io::Result<libc::sigset_t> {
        // SAFETY: a zeroed sigset_t is initialized by sigemptyset; each call gets a valid pointer to it.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            match libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) {
                0 => Ok(set),
                e => Err(std::io::Error::from_raw_os_error(e)),
            }
        }
    }

    /// On a signal of `set`: kills `server` unless it was reaped ([`super::kill_unless_reaped`]: the thread
    /// outlives it), unmounts `mountpoint` (lazily), removes `work`, and exits as the signal would have
    /// (128 + its number).
    pub fn clean_up_on(
        set: libc::sigset_t,
        server: Arc<Mutex<Child>>,
        mountpoint: PathBuf,
        work: PathBuf,
    ) -> std::io::Result<()> {
        std::thread::Builder::new().name("demo-signals".into()).spawn(move || {
            let mut signal = 0;
            // SAFETY: sigwait reads the set and writes one int through a pointer to a live local.
            if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
                return;
            }
            eprintln!("signal {signal}: stopping the server, unmounting and removing {}", work.display());
            super::kill_unless_reaped(&server);
            let _ = batchfs_mount::sys::unmount(&mountpoint, true);
            let _ = std::fs::remove_dir_all(&work);
            std::process::exit(128 + signal);
        })?;
        Ok(())
    }
}

fn server_binary(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p.to_owned());
    }
    let beside = std::env::current_exe()?.with_file_name("batchfs-server");
    if beside.exists() {
        return Ok(beside);
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("batchfs-server"))
        .find(|p| p.exists());
    on_path.context("batchfs-server not found: build the workspace first (cargo build --release --workspace)")
}

/// Reads every file fully; returns (bytes, CRC32C) per file.
fn read_file(path: &Path) -> Result<(u64, u32)> {
    let mut file = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut len, mut crc) = (0u64, 0u32);
    loop {
        let n = file.read(&mut buf).with_context(|| format!("read {}", path.display()))?;
        if n == 0 {
            return Ok((len, crc));
        }
        crc = batchfs::crc::crc32c_append(crc, &buf[..n]);
        len += n as u64;
    }
}

/// Runs the demo.
pub fn run(args: DemoArgs) -> Result<()> {
    let signals = stop_signals::block()?;
    let work = tempfile::tempdir()?;
    let data = work.path().join("sample-tfrecord");
    let t = Instant::now();
    let generated = gen::generate(&args.sample.dataset(), &data)?;
    let gen_secs = t.elapsed().as_secs_f64();

    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let server = server_binary(args.server.as_deref())?;
    let mut server = ServerProcess::start(&server, port, &data, work.path().join("server.log"))?;
    let url = format!("http://127.0.0.1:{port}/sample");
    let mountpoint = work.path().join("mnt");
    std::fs::create_dir(&mountpoint)?;
    stop_signals::clean_up_on(signals, server.child.clone(), mountpoint.clone(), work.path().to_owned())?;
    let mut mount_options = MountOptions { prefetch: args.prefetch, ..MountOptions::default() };
    mount_options.plan.batch_size = args.sample.batch_size;
    let deadline = Instant::now() + Duration::from_secs(60);
    let plan = wait_for_plan(&mut server, &url, &mountpoint, &mount_options, deadline)?;
    let mounted = batchfs_mount::mount::spawn(&plan)?;
    let manifest = mounted.prefetcher.manifest(0, BatchFormat::Tfrecord).map_err(anyhow::Error::msg)?;
    let epoch = mountpoint.join(batchfs_mount::fs::epoch_name(0));
    let files: Vec<PathBuf> = (0..manifest.batches.len() as u64)
        .map(|b| epoch.join(batchfs_mount::fs::batch_name(b, BatchFormat::Tfrecord)))
        .collect();
    let listed = std::fs::read_dir(&epoch)?.count();

    let started = Instant::now();
    let readers = args.readers;
    let results: Vec<Result<Vec<(usize, u64, u32)>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..readers)
            .map(|r| {
                let files = &files;
                scope.spawn(move || {
                    (r..files.len())
                        .step_by(readers)
                        .map(|i| read_file(&files[i]).map(|(len, crc)| (i, len, crc)))
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("reader thread")).collect()
    });
    let secs = started.elapsed().as_secs_f64();
    let mut tally = Tally::default();
    for result in results {
        for (i, len, crc) in result? {
            tally.check(0, &manifest.batches[i], len, crc)?;
        }
    }
    let Tally { batches: verified, bytes } = tally;
    let stats = mounted.prefetcher.stats.snapshot();
    mounted.unmount()?;

    // Reads that reached the daemon, and opens served by the kernel (passthrough): each looked its file up.
    let lookups = stats.reads + stats.passthrough_opens;
    let hit_rate = if lookups > 0 { 100.0 * stats.hits as f64 / lookups as f64 } else { 0.0 };
    let path = if stats.passthrough {
        format!("kernel passthrough: {} opens, {} reads through the daemon", stats.passthrough_opens, stats.reads)
    } else {
        format!("through the daemon: {} reads", stats.reads)
    };
    let rows = vec![
        (
            "dataset",
            format!(
                "{} samples, {:.1} MB in {} TFRecord shards (generated in {gen_secs:.2} s)",
                generated.samples,
                generated.bytes as f64 / 1e6,
                generated.files
            ),
        ),
        (
            "mount",
            format!(
                "{url} -> {} (batch_size {}, prefetch {})",
                mountpoint.display(),
                args.sample.batch_size,
                args.prefetch
            ),
        ),
        (
            "epoch-0000",
            format!("{} batch files listed, {} read by {readers} readers (interleaved)", listed, files.len()),
        ),
        ("bytes", format!("{:.1} MB", bytes as f64 / 1e6)),
        ("seconds", format!("{secs:.3}")),
        ("throughput", format!("{:.0} MB/s", bytes as f64 / 1e6 / secs)),
        ("read path", path),
        (
            "cache hit rate",
            format!(
                "{hit_rate:.1} % of {lookups} reads and opens ({} fetched on demand, {} prefetched)",
                stats.misses, stats.prefetches
            ),
        ),
        ("time stalled", format!("{:.3} s over {} stalled reads/opens", stats.stall_us as f64 / 1e6, stats.stalls)),
        ("checksums", format!("{verified}/{} batch files match the manifest (CRC32C)", files.len())),
    ];
    let table = Table {
        title: "batchfs-lab demo: one epoch read through a FUSE mount of batchfs-server on loopback".into(),
        rows,
    };
    println!("\n{table}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sleep 30` as the demo starts its server.
    fn sleeper(dir: &Path) -> ServerProcess {
        let mut command = Command::new("sleep");
        command.arg("30");
        ServerProcess::spawn(command, Path::new("sleep"), dir.join("log")).unwrap()
    }

    /// The signal thread lives on after the server is reaped (as `run` returns): a signal then kills
    /// nothing (it sent SIGKILL to the server's pid, another process's once reused). Before, it kills it.
    #[test]
    fn a_signal_after_the_server_was_reaped_kills_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let server = sleeper(dir.path());
        let (shared, pid) = (server.child.clone(), server.child.lock().unwrap().id());
        drop(server);
        assert!(!kill_unless_reaped(&shared), "pid {pid}, reaped, was signalled");
        let server = sleeper(dir.path());
        assert!(kill_unless_reaped(&server.child));
        let status = server.child.lock().unwrap().wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGKILL));
    }

    /// A child whose parent is gone by the time it sets `PR_SET_PDEATHSIG` (its parent is then another
    /// process) does not start: the signal would never come, and it would outlive the demo. Here the
    /// parent it expects is one it does not have, as after such a death.
    #[test]
    fn a_server_whose_demo_is_gone_before_it_starts_does_not_start() {
        use std::os::unix::process::CommandExt;
        let mut orphan = Command::new("true");
        // SAFETY: die_with_parent makes async-signal-safe calls only.
        unsafe { orphan.pre_exec(|| die_with_parent(libc::pid_t::MAX, libc::SIGTERM)) };
        let e = orphan.spawn().err();
        assert_eq!(e.as_ref().and_then(std::io::Error::raw_os_error), Some(libc::ESRCH), "{e:?}");
        let dir = tempfile::tempdir().unwrap();
        drop(sleeper(dir.path()));
    }

    /// `--readers 0` is refused (it ran with one reader).
    #[test]
    fn zero_readers_are_refused() {
        use clap::Parser;
        let readers = |n: &str| match crate::Cli::try_parse_from(["batchfs-lab", "demo", "--readers", n]) {
            Ok(crate::Cli { command: crate::Command::Demo(args) }) => Ok(args.readers),
            Ok(_) => unreachable!(),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(readers("2"), Ok(2));
        let e = readers("0").unwrap_err();
        assert!(e.contains("invalid value '0' for '--readers <READERS>'"), "{e}");
    }
}
