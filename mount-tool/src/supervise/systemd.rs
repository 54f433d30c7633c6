//! The supervisor under systemd (docs/DEPLOYMENT.md): with `NOTIFY_SOCKET`, it stores the connection, the
//! ledger and the dataset's description with systemd (`FDSTORE=1`) once a worker serves; started again
//! with them in `LISTEN_FDS`, it takes the mount over instead of mounting.

use super::Held;
use crate::ledger::Ledger;
use anyhow::{Context, Result};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

/// The names of the descriptors stored with systemd.
const STORED_FUSE: &str = "batchfs-fuse";
const STORED_LEDGER: &str = "batchfs-ledger";
const STORED_INFO: &str = "batchfs-info";

/// The descriptors systemd passed this process (`LISTEN_FDS` for this pid), by `LISTEN_FDNAMES`.
fn listen_fds() -> Vec<(String, RawFd)> {
    let pid_ok = std::env::var("LISTEN_PID").ok().and_then(|p| p.parse::<u32>().ok()) == Some(std::process::id());
    let count = std::env::var("LISTEN_FDS").ok().and_then(|n| n.parse::<i32>().ok()).unwrap_or(0);
    if !pid_ok || count <= 0 {
        return Vec::new();
    }
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    let names: Vec<&str> = names.split(':').collect();
    (0..count).map(|i| (names.get(i as usize).unwrap_or(&"").to_string(), 3 + i)).collect()
}

/// Whether systemd passed this process a mount to take over (stored by a supervisor before it).
pub fn kept_by_systemd() -> bool {
    listen_fds().iter().any(|(name, _)| name == STORED_FUSE)
}

/// The mount systemd kept for this unit (stored by a supervisor before this one), if it passed it.
pub(super) fn stored_with_systemd() -> Result<Option<Held>> {
    let fds = listen_fds();
    let find = |name: &str| fds.iter().find(|(n, _)| n == name).map(|&(_, fd)| fd);
    let (Some(fuse), Some(ledger), Some(info)) = (find(STORED_FUSE), find(STORED_LEDGER), find(STORED_INFO)) else {
        return Ok(None);
    };
    // SAFETY: systemd passed these descriptors to this process, and nothing else owns them.
    let (fuse, ledger, info) =
        unsafe { (OwnedFd::from_raw_fd(fuse), File::from_raw_fd(ledger), File::from_raw_fd(info)) };
    for fd in [fuse.as_raw_fd(), ledger.as_raw_fd(), info.as_raw_fd()] {
        // SAFETY: F_SETFD on a descriptor this process owns.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    let ledger = Ledger::open(ledger).context("the mount systemd kept")?;
    for key in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(key);
    }
    Ok(Some(Held { fuse, ledger, info, mounted: None, mount_id: None }))
}

/// Stores the connection, the ledger and the description with systemd, when it supervises this process
/// (`NOTIFY_SOCKET`), and says the mount is ready.
pub(super) fn store_with_systemd(held: &Held) -> std::io::Result<()> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return Ok(()) };
    let socket = std::os::unix::net::UnixDatagram::unbound()?;
    let target = notify_address(&path)?;
    let stored = [
        (STORED_FUSE, held.fuse.as_fd()),
        (STORED_LEDGER, held.ledger.file().as_fd()),
        (STORED_INFO, held.info.as_fd()),
    ];
    for (name, fd) in stored {
        // Stored again by a supervisor that took over: systemd replaces a name's descriptor only with
        // FDSTOREREMOVE first.
        crate::sys::send_with_fd(&socket, &target, format!("FDSTOREREMOVE=1\nFDNAME={name}").as_bytes(), None)?;
        crate::sys::send_with_fd(&socket, &target, format!("FDSTORE=1\nFDNAME={name}").as_bytes(), Some(fd))?;
    }
    crate::sys::send_with_fd(&socket, &target, b"READY=1", None)
}

/// Drops what [`store_with_systemd`] stored, when systemd supervises this process: the mount has ended
/// (unmounted, given up), and a unit started again must mount anew, not take over a connection that is
/// gone (with `Restart=` it would, and its workers would find nothing to serve).
pub(super) fn forget_with_systemd() -> std::io::Result<()> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return Ok(()) };
    let socket = std::os::unix::net::UnixDatagram::unbound()?;
    let target = notify_address(&path)?;
    for name in [STORED_FUSE, STORED_LEDGER, STORED_INFO] {
        crate::sys::send_with_fd(&socket, &target, format!("FDSTOREREMOVE=1\nFDNAME={name}").as_bytes(), None)?;
    }
    Ok(())
}

fn notify_address(path: &std::ffi::OsStr) -> std::io::Result<std::os::unix::net::SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::ffi::OsStrExt;
    match path.as_bytes().strip_prefix(b"@") {
        Some(name) => std::os::unix::net::SocketAddr::from_abstract_name(name),
        None => std::os::unix::net::SocketAddr::from_pathname(Path::new(path)),
    }
}
