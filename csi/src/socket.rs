//! The unix sockets the plugin and the holder listen on. A socket's path appears only once it accepts
//! connections: it is bound and listened on under a name of its own in the same directory, given its
//! permissions, and renamed into place. Bound at its path directly, the path existed between `bind` and
//! `listen`, and a client that saw it then was refused (`ECONNREFUSED`), as the CSI test's client was
//! under load; the holder's socket also had the default permissions until its `chmod`. The rename
//! replaces a socket a killed process left behind.

use anyhow::Context;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// A listener at `socket` (its directory made if missing), with permissions `mode` if given.
pub fn listen_at(socket: &Path, mode: Option<u32>) -> anyhow::Result<tokio::net::UnixListener> {
    let name = socket.file_name().with_context(|| format!("{} names no socket", socket.display()))?;
    if let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot make {}", dir.display()))?;
    }
    // A few bytes longer than the socket's name: a path near the 108 bytes a socket's may have fails here.
    let staged: PathBuf = socket.with_file_name(format!(".{}.new", name.to_string_lossy()));
    match std::fs::remove_file(&staged) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("cannot replace {}", staged.display()))
        }
        _ => {}
    }
    let listening = (|| {
        let listener = std::os::unix::net::UnixListener::bind(&staged)?;
        if let Some(mode) = mode {
            std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))?;
        }
        std::fs::rename(&staged, socket)?;
        listener.set_nonblocking(true)?;
        tokio::net::UnixListener::from_std(listener)
    })();
    if listening.is_err() {
        let _ = std::fs::remove_file(&staged);
    }
    listening.with_context(|| format!("cannot listen at {}", socket.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_socket_appears_listening_with_its_mode_and_replaces_a_dead_ones_file() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("sub/csi.sock");
        // A socket a killed process left: its file is there, nothing listens.
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        assert!(std::os::unix::net::UnixStream::connect(&socket).is_err(), "refused: nothing listens");
        let listener = listen_at(&socket, Some(0o600)).unwrap();
        let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let mut client = tokio::net::UnixStream::connect(&socket).await.unwrap();
        let (mut accepted, _) = listener.accept().await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        client.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        accepted.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        let names: Vec<_> =
            std::fs::read_dir(socket.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["csi.sock"], "no staged name left");
    }

    #[test]
    fn a_path_too_long_for_a_socket_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join(format!("{}.sock", "s".repeat(120)));
        let e = format!("{:#}", listen_at(&socket, None).unwrap_err());
        assert!(e.contains("cannot listen at") && e.contains("sss.sock"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing left");
    }
}
