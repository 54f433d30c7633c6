//! The holder: `batchfs-csi holder --socket PATH --program PATH`, the process that starts the mounts in a
//! container of its own, so that the plugin's container can be killed, restarted or upgraded while every
//! mount goes on serving.
//!
//! It holds nothing itself either: each mount is a `batchfs mount` supervisor in a session of its own,
//! which survives the holder's process too. What ties the mounts to the holder is its container: when the
//! container's init goes, the kernel kills every process of its PID namespace, supervisors included. So
//! the holder is small and rarely upgraded (nothing in it changes with the mount's code: workers are
//! upgraded in place from the program the plugin installs), and as the container's init (PID 1) it forks
//! first and stays a reaper ([`init`]) that starts the holder again when it dies.
//!
//! The protocol, on a unix stream socket only root can reach: one JSON line asked (a
//! [`Request`]), one answered (a [`Reply`]).

use crate::runner::{run_here, Reply, Request};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// Serves requests on `socket` until the process ends, running mounts of `program`.
pub async fn serve(socket: &Path, program: PathBuf, timeout: Duration) -> anyhow::Result<()> {
    // Only root (the plugin) may ask the holder for mounts.
    let listener = crate::socket::listen_at(socket, Some(0o600))?;
    tracing::info!(socket = %socket.display(), program = %program.display(), "the holder serves");
    loop {
        let (stream, _) = listener.accept().await?;
        let program = program.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            if BufReader::new(read).read_line(&mut line).await.is_err() {
                return;
            }
            let reply = match serde_json::from_str::<Request>(&line) {
                Ok(request) => {
                    tracing::info!(?request, "asked");
                    let done = run_here(&program, &request, timeout).await;
                    if let Err(e) = &done {
                        tracing::warn!(?request, error = %e, "failed");
                    }
                    Reply { error: done.err().map(|e| e.to_string()) }
                }
                Err(e) => Reply { error: Some(format!("a request the holder does not understand: {e}")) },
            };
            let mut answer = serde_json::to_vec(&reply).expect("a reply serializes");
            answer.push(b'\n');
            let _ = write.write_all(&answer).await;
        });
    }
}

/// When this process is its PID namespace's init (PID 1, a container's entry point): forks, and the
/// parent stays init for good, reaping every orphan (the mounts' supervisors are re-parented to it) and
/// starting the holder again whenever it dies; SIGTERM or SIGINT are passed on to the holder, and init
/// exits with it then. Returns in the child (the holder to run), at once when not PID 1.
pub fn init() {
    if std::process::id() != 1 {
        return;
    }
    loop {
        // SAFETY: no thread has been started yet (main calls this first), so the child may go on running
        // Rust code after fork.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // The holder: signals act as they do on any process (init's handlers below are init's own, and a
            // holder started again would inherit them).
            // SAFETY: signal with SIG_DFL installs no handler.
            unsafe {
                libc::signal(libc::SIGTERM, libc::SIG_DFL);
                libc::signal(libc::SIGINT, libc::SIG_DFL);
            }
            return;
        }
        if pid < 0 {
            eprintln!("batchfs-csi: cannot fork the holder: {}", std::io::Error::last_os_error());
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        HOLDER.store(pid, std::sync::atomic::Ordering::SeqCst);
        // SAFETY: the handler only makes async-signal-safe calls (an atomic load and store, kill).
        unsafe {
            libc::signal(libc::SIGTERM, forward as *const () as libc::sighandler_t);
            libc::signal(libc::SIGINT, forward as *const () as libc::sighandler_t);
        }
        loop {
            let mut status = 0;
            // SAFETY: waitpid writes the status it is given a pointer to.
            let reaped = unsafe { libc::waitpid(-1, &mut status, 0) };
            if reaped == pid {
                if STOPPING.load(std::sync::atomic::Ordering::SeqCst) {
                    std::process::exit(0);
                }
                eprintln!("batchfs-csi: the holder (pid {pid}) died: starting it again");
                std::thread::sleep(Duration::from_millis(200));
                break;
            }
            if reaped < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

static HOLDER: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn forward(signal: libc::c_int) {
    STOPPING.store(true, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: kill is async-signal-safe and has no memory-safety preconditions.
    unsafe { libc::kill(HOLDER.load(std::sync::atomic::Ordering::SeqCst), signal) };
}
