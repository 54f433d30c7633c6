//! Who runs the mounts: the plugin itself ([`Runner::Local`]), or the holder ([`Runner::Holder`], a
//! process in a container of its own that outlives the plugin's: `holder.rs`). Either way a mount is a
//! `batchfs mount` command, which returns once the mount serves and leaves a supervisor holding it in a
//! session of its own; an unmount is the mount's unmount, an upgrade `batchfs mount --upgrade`.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// What the plugin asks of its runner: of the holder, one JSON line on its socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Mount dataset `url` at `target` with the `-o` string `options`.
    Mount { url: String, target: PathBuf, options: String },
    /// Unmount `target`.
    Unmount { target: PathBuf },
    /// Replace the worker of the mount at `target` by the program installed now.
    Upgrade { target: PathBuf },
    /// Answer (the plugin's `Probe`).
    Ping,
}

/// The holder's answer: no error is done.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Reply {
    pub error: Option<String>,
}

/// What runs the mounts' commands.
#[derive(Debug, Clone)]
pub enum Runner {
    /// The plugin runs them: `program` is the `batchfs` program the mounts run.
    Local { program: PathBuf, timeout: Duration },
    /// The holder listening at `socket` runs them, with its own program.
    Holder { socket: PathBuf, timeout: Duration },
}

/// Why a command failed: the holder could not be reached (`UNAVAILABLE` to the kubelet, which tries
/// again), or the command ran and failed, saying why.
#[derive(Debug)]
pub enum RunError {
    Unreachable(String),
    Failed(String),
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Unreachable(m) | RunError::Failed(m) => f.write_str(m),
        }
    }
}

impl Runner {
    /// Mounts dataset `url` at `target` with the `-o` string `options`, returning once the mount serves.
    pub async fn mount(&self, url: &str, target: &Path, options: &str) -> Result<(), RunError> {
        self.run(Request::Mount { url: url.into(), target: target.into(), options: options.into() }).await
    }

    /// Unmounts `target` (detaching it lazily if files are still open there).
    pub async fn unmount(&self, target: &Path) -> Result<(), RunError> {
        self.run(Request::Unmount { target: target.into() }).await
    }

    /// Has the supervisor of the mount at `target` replace its worker by the program installed now.
    pub async fn upgrade(&self, target: &Path) -> Result<(), RunError> {
        self.run(Request::Upgrade { target: target.into() }).await
    }

    /// Whether the runner answers (the holder is up): what `Probe` reports.
    pub async fn ready(&self) -> bool {
        match self {
            Runner::Local { program, .. } => program.is_file(),
            Runner::Holder { .. } => self.run(Request::Ping).await.is_ok(),
        }
    }

    async fn run(&self, request: Request) -> Result<(), RunError> {
        match self {
            Runner::Local { program, timeout } => run_here(program, &request, *timeout).await,
            Runner::Holder { socket, timeout } => ask(socket, &request, *timeout).await,
        }
    }
}

/// Runs `request` in this process.
pub async fn run_here(program: &Path, request: &Request, timeout: Duration) -> Result<(), RunError> {
    let failed = |m: String| Err(RunError::Failed(m));
    match request {
        Request::Ping => Ok(()),
        Request::Mount { url, target, options } => {
            let mut args = vec!["mount".into(), url.clone(), target.to_string_lossy().into_owned()];
            if !options.is_empty() {
                args.extend(["-o".into(), options.clone()]);
            }
            command(program, &args, timeout).await
        }
        Request::Upgrade { target } => {
            command(program, &["mount".into(), "--upgrade".into(), target.to_string_lossy().into_owned()], timeout)
                .await
        }
        Request::Unmount { target } => {
            let target = target.clone();
            let done = tokio::task::spawn_blocking(move || unmount(&target)).await;
            match done {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => failed(e.to_string()),
                Err(e) => failed(format!("the unmount task failed: {e}")),
            }
        }
    }
}

/// Unmounts `target`: at once when nothing is open there, lazily (detached now, gone once the last file
/// closes) when something is. Nothing mounted there is done already.
fn unmount(target: &Path) -> Result<(), UnmountError> {
    if !batchfs_mount::plan::is_mountpoint(target) {
        return Ok(());
    }
    match batchfs_mount::sys::unmount(target, false) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        Err(e) => {
            tracing::warn!(target = %target.display(), error = %e, "cannot unmount now: detaching lazily");
            batchfs_mount::sys::unmount(target, true).map_err(|source| UnmountError { target: target.into(), source })
        }
    }
}

/// An unmount the kernel refused, lazily too.
#[derive(Debug, thiserror::Error)]
#[error("cannot unmount {}: {source}", target.display())]
struct UnmountError {
    target: PathBuf,
    source: std::io::Error,
}

/// Runs `program args`, waiting at most `timeout`; its error output is the failure's message.
async fn command(program: &Path, args: &[String], timeout: Duration) -> Result<(), RunError> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null());
    cmd.stderr(std::process::Stdio::piped()).kill_on_drop(true);
    let child = cmd.spawn().map_err(|e| RunError::Failed(format!("cannot run {}: {e}", program.display())))?;
    let output = match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Ok(Ok(output)) => output,
        Ok(Err(e)) => return Err(RunError::Failed(format!("{}: {e}", program.display()))),
        Err(_) => {
            return Err(RunError::Failed(format!(
                "`{} {}` did not finish within {timeout:?}",
                program.display(),
                args.join(" ")
            )))
        }
    };
    if output.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&output.stderr);
    // The error batchfs printed (the last lines: what logging came before is context, kept in the log).
    let said = said.trim();
    let said = said.rfind("Error: ").map(|i| &said[i + "Error: ".len()..]).unwrap_or(said);
    tracing::debug!(program = %program.display(), ?args, stderr = %said, "the command failed");
    Err(RunError::Failed(format!("batchfs {} failed ({}): {}", args[0], output.status, said.trim())))
}

/// Asks the holder at `socket` to run `request`.
async fn ask(socket: &Path, request: &Request, timeout: Duration) -> Result<(), RunError> {
    let unreachable = |e: std::io::Error| {
        RunError::Unreachable(format!(
            "the holder at {} does not answer: {e} (is batchfs-csi holder running?)",
            socket.display()
        ))
    };
    let exchange = async {
        let stream = tokio::net::UnixStream::connect(socket).await.map_err(unreachable)?;
        let (read, mut write) = stream.into_split();
        let mut line = serde_json::to_vec(request).expect("a request serializes");
        line.push(b'\n');
        write.write_all(&line).await.map_err(unreachable)?;
        let mut answer = String::new();
        BufReader::new(read).read_line(&mut answer).await.map_err(unreachable)?;
        let reply: Reply = serde_json::from_str(&answer).map_err(|e| {
            RunError::Unreachable(format!("the holder at {} answered {answer:?}: {e}", socket.display()))
        })?;
        match reply.error {
            None => Ok(()),
            Some(e) => Err(RunError::Failed(e)),
        }
    };
    // The holder's own command has `timeout`: a little more for the exchange around it.
    match tokio::time::timeout(timeout + Duration::from_secs(5), exchange).await {
        Ok(result) => result,
        Err(_) => Err(RunError::Unreachable(format!("the holder at {} did not answer in time", socket.display()))),
    }
}
