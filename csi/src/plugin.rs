//! The plugin's process: the gRPC server on the kubelet's unix socket, and the program the mounts run
//! installed (and the mounts upgraded to it) when it changed.

use crate::identity::IdentityService;
use crate::node::NodeService;
use crate::proto::identity_server::IdentityServer;
use crate::proto::node_server::NodeServer;
use crate::runner::Runner;
use crate::volume::State;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How the plugin runs.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// The socket the kubelet calls (`unix:///csi/csi.sock`, or a path).
    pub endpoint: String,
    pub node_id: String,
    pub state_dir: PathBuf,
    pub runner: Runner,
    /// The `batchfs` program shipped with the plugin, and where to install it for the mounts (the path
    /// the holder's `--program` names), when the plugin installs it.
    pub install: Option<(PathBuf, PathBuf)>,
}

/// The socket path of a CSI endpoint: `unix:///path`, `unix:/path` or a plain path.
pub fn socket_path(endpoint: &str) -> Result<PathBuf> {
    let path = endpoint.strip_prefix("unix://").or_else(|| endpoint.strip_prefix("unix:")).unwrap_or(endpoint);
    if path.is_empty() || endpoint.contains("://") && !endpoint.starts_with("unix://") {
        bail!("{endpoint:?}: expected unix:///PATH or a path (a unix socket)");
    }
    Ok(PathBuf::from(path))
}

/// Copies `from` to `to` when their bytes differ (to a temporary name beside it, then renamed, so that a
/// supervisor starting a worker at that moment runs one program or the other, whole); whether it did.
pub fn install_program(from: &Path, to: &Path) -> Result<bool> {
    let new = std::fs::read(from).with_context(|| format!("cannot read the program {}", from.display()))?;
    if std::fs::read(to).is_ok_and(|old| old == new) {
        return Ok(false);
    }
    batchfs::atomic::write(to, &new, 0o755).with_context(|| format!("cannot install {}", to.display()))?;
    Ok(true)
}

/// Runs the plugin until SIGTERM or SIGINT.
pub async fn run(config: PluginConfig) -> Result<()> {
    let socket = socket_path(&config.endpoint)?;
    let state = State::open(&config.state_dir)
        .with_context(|| format!("cannot use the state directory {}", config.state_dir.display()))?;
    let upgraded = match &config.install {
        Some((from, to)) => {
            let changed = install_program(from, to)?;
            if changed {
                tracing::info!(program = %to.display(), "installed the mounts' program");
            }
            changed
        }
        None => false,
    };
    let node = Arc::new(NodeService {
        node_id: config.node_id.clone(),
        state,
        runner: config.runner.clone(),
        lock: Default::default(),
    });
    if upgraded {
        let node = node.clone();
        tokio::spawn(async move { node.upgrade_mounts().await });
    }
    let listener = crate::socket::listen_at(&socket, None)?;
    tracing::info!(endpoint = %socket.display(), node = %config.node_id, runner = ?config.runner, "serving CSI");
    let identity = IdentityService { runner: config.runner.clone() };
    let stop = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("stopping (the mounts go on)");
    };
    tonic::transport::Server::builder()
        .add_service(IdentityServer::new(identity))
        .add_service(NodeServer::from_arc(node))
        .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(listener), stop)
        .await
        .context("the gRPC server failed")?;
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_unix_sockets() {
        assert_eq!(socket_path("unix:///csi/csi.sock").unwrap(), PathBuf::from("/csi/csi.sock"));
        assert_eq!(socket_path("unix:/csi/csi.sock").unwrap(), PathBuf::from("/csi/csi.sock"));
        assert_eq!(socket_path("/csi/csi.sock").unwrap(), PathBuf::from("/csi/csi.sock"));
        assert!(socket_path("tcp://0.0.0.0:10000").is_err());
        assert!(socket_path("unix://").is_err());
    }

    #[test]
    fn a_program_is_installed_when_its_bytes_differ_and_only_then() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("batchfs"), dir.path().join("installed/batchfs"));
        std::fs::write(&from, b"one").unwrap();
        assert!(install_program(&from, &to).unwrap());
        assert!(!install_program(&from, &to).unwrap());
        std::fs::write(&from, b"two").unwrap();
        assert!(install_program(&from, &to).unwrap());
        assert_eq!(std::fs::read(&to).unwrap(), b"two");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&to).unwrap().permissions().mode() & 0o777, 0o755);
        assert!(install_program(&dir.path().join("missing"), &to).is_err());
    }
}
