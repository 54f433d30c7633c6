//! The CSI Node service: `NodePublishVolume` mounts a volume at the pod's target path, read-only;
//! `NodeUnpublishVolume` unmounts it. Both are idempotent, across the plugin's restarts too (the state
//! directory says what was published where).
//!
//! One supervised mount per published target, not one per dataset bind-mounted to each: each pod reads its
//! own epochs at its own pace (a mount's prefetch, window and cache follow one reader's plan), volumes of
//! one dataset may differ in their options (batch size, seed, shuffle), and one pod's mount going away
//! never touches another's. Two pods of one node reading one dataset share the node's disk cache when
//! their options name the same `cache_dir` (below the state directory's `cache/`: `volume::node_paths`).
//!
//! Codes: a request missing or misstating something is `INVALID_ARGUMENT` (the message says what); a
//! target path that is not a directory, or holds a mount the plugin did not make, `FAILED_PRECONDITION`;
//! the same target published with other attributes `ALREADY_EXISTS`; a dataset the server does not know
//! `NOT_FOUND`; a token the server refuses `PERMISSION_DENIED`; a server (or the holder) that cannot be
//! reached `UNAVAILABLE` (the kubelet tries again); a mount that fails after all that `INTERNAL`.

use crate::proto::node_server::Node;
use crate::proto::{
    NodeGetCapabilitiesRequest, NodeGetCapabilitiesResponse, NodeGetInfoRequest, NodeGetInfoResponse,
    NodePublishVolumeRequest, NodePublishVolumeResponse, NodeUnpublishVolumeRequest, NodeUnpublishVolumeResponse,
};
use crate::runner::{RunError, Runner};
use crate::volume::{describe, target_path, State, Volume};
use batchfs_mount::plan::{batchfs_mounted_at, is_mountpoint, Refused};
use std::path::Path;
use tonic::{Request, Response, Status};

/// The Node service.
pub struct NodeService {
    pub node_id: String,
    pub state: State,
    pub runner: Runner,
    /// Publishes and unpublishes one at a time (they are rare, and each checks then changes a target).
    pub lock: tokio::sync::Mutex<()>,
}

fn internal(what: &str, e: impl std::fmt::Display) -> Status {
    Status::internal(format!("{what}: {e}"))
}

/// The runner's failure as a status: the holder unreachable is `UNAVAILABLE`, a command failing `INTERNAL`.
fn run_status(e: RunError) -> Status {
    match e {
        RunError::Unreachable(m) => Status::unavailable(m),
        RunError::Failed(m) => Status::internal(m),
    }
}

/// The server's refusal of a volume (found by [`batchfs_mount::plan::check`]) as a status.
fn refusal(volume: &Volume, e: &anyhow::Error) -> Status {
    let message = format!("volume {:?} ({}): {e:#}", volume.id, volume.url);
    match e.downcast_ref::<Refused>() {
        Some(Refused::UnknownDataset { .. }) => Status::not_found(message),
        Some(Refused::Token { .. }) => Status::permission_denied(format!(
            "{message} (the token is the key \"token\" of the volume's node-publish secret)"
        )),
        Some(Refused::Unreachable { .. }) => Status::unavailable(message),
        // The server rejected the plan, or the options cannot work (a cache too small for its batches).
        Some(Refused::Options { .. }) | None => Status::invalid_argument(message),
    }
}

/// What a target path holds before a publish.
#[derive(Debug, PartialEq)]
enum Target {
    /// A directory (mounted on or not).
    Directory,
    /// Nothing: the plugin made the directory (the spec leaves that to it), and removes it on failure.
    Made,
    /// A mount whose daemon is gone (its supervisor died with a holder's container): to be detached.
    Stale,
}

/// Makes `target` a directory to mount on.
fn prepare_target(target: &Path) -> Result<Target, Status> {
    // Listing the directory reaches the filesystem mounted there (its attributes may be answered from the
    // kernel's cache even once its daemon is gone).
    let probe =
        std::fs::metadata(target).and_then(|m| if m.is_dir() { std::fs::read_dir(target).map(|_| m) } else { Ok(m) });
    match probe {
        Ok(m) if m.is_dir() => Ok(Target::Directory),
        Ok(_) => {
            Err(Status::failed_precondition(format!("target_path {} exists and is not a directory", target.display())))
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED)) => Ok(Target::Stale),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::create_dir(target) {
            Ok(()) => Ok(Target::Made),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Status::failed_precondition(format!(
                "the parent directory of target_path {} does not exist",
                target.display()
            ))),
            Err(e) => Err(internal(&format!("cannot make target_path {}", target.display()), e)),
        },
        Err(e) => Err(internal(&format!("target_path {}", target.display()), e)),
    }
}

/// Where `target` is, as the mount table names it: its parent resolved (symbolic links, `..`), its own name
/// kept (it may be a mount whose daemon is gone, which cannot be looked into).
fn resolved(target: &Path) -> std::path::PathBuf {
    match (target.parent().map(std::fs::canonicalize), target.file_name()) {
        (Some(Ok(parent)), Some(name)) => parent.join(name),
        _ => target.to_owned(),
    }
}

impl NodeService {
    async fn publish(&self, req: NodePublishVolumeRequest) -> Result<(), Status> {
        let (volume, mut options) = Volume::from_request(&req, self.state.dir())?;
        let _one = self.lock.lock().await;
        let target = volume.target.as_path();
        let prepared = prepare_target(target)?;
        let at = resolved(target);
        if prepared == Target::Stale {
            // Detached where the mounts are made (the holder's mount namespace propagates to the host's).
            tracing::warn!(target = %target.display(), "detaching a stale mount (its daemon is gone)");
            self.runner.unmount(&at).await.map_err(run_status)?;
        }
        let created = prepared == Target::Made;
        let record = self.state.get(target).map_err(|e| internal("cannot read the plugin's state", e))?;
        if is_mountpoint(&at) {
            return match record {
                Some(r) if r == volume.record() => {
                    tracing::info!(volume = %volume.id, target = %target.display(), "published already");
                    Ok(())
                }
                Some(r) => Err(Status::already_exists(format!(
                    "{} is published at {} already, with other attributes or secret than asked ({}): unpublish it \
                     first",
                    describe(&r),
                    target.display(),
                    describe(&volume.record())
                ))),
                None => Err(Status::failed_precondition(format!(
                    "something this plugin did not mount is mounted at target_path {}",
                    target.display()
                ))),
            };
        }
        let undo = |state: &State| {
            let _ = state.remove(target);
            if created {
                let _ = std::fs::remove_dir(target);
            }
        };
        let token_file = match &volume.token {
            Some(token) => Some(self.state.put_token(target, token).map_err(|e| {
                undo(&self.state);
                internal("cannot keep the volume's token", e)
            })?),
            None => None,
        };
        options.token_file = token_file.clone();
        // The server's refusals, told apart (a mount's own errors are text by the time they come back).
        let url = volume.url.clone();
        let checked = tokio::task::spawn_blocking(move || batchfs_mount::plan::check(&url, &options))
            .await
            .map_err(|e| internal("the check task failed", e))?;
        if let Err(e) = checked {
            undo(&self.state);
            return Err(refusal(&volume, &e));
        }
        // Kept before mounting: a plugin killed while the mount is made finds the record, and a publish
        // asked again mounts (nothing there) or answers done (mounted).
        self.state.put(&volume.record()).map_err(|e| internal("cannot keep the volume's record", e))?;
        let log_file = self.state.log_path(target);
        let mount_options = volume.mount_options(token_file.as_deref(), Some(&log_file));
        if let Err(e) = self.runner.mount(&volume.url, &at, &mount_options).await {
            undo(&self.state);
            return Err(run_status(e));
        }
        tracing::info!(volume = %volume.id, url = %volume.url, target = %target.display(), "published");
        Ok(())
    }

    async fn unpublish(&self, req: NodeUnpublishVolumeRequest) -> Result<(), Status> {
        if req.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is missing"));
        }
        let target = target_path(&req.target_path)?;
        let _one = self.lock.lock().await;
        let record = self.state.get(&target).map_err(|e| internal("cannot read the plugin's state", e))?;
        if let Some(r) = &record {
            if r.volume_id != req.volume_id {
                return Err(Status::not_found(format!(
                    "volume {:?} is not published at {} ({} is)",
                    req.volume_id,
                    target.display(),
                    describe(r)
                )));
            }
        }
        let at = resolved(&target);
        match batchfs_mounted_at(&at) {
            // Another filesystem (a bind mount, a tmpfs) is not this plugin's to take away, with or without
            // a record: left alone, as a publish leaves it.
            Some(false) => {
                return Err(Status::failed_precondition(format!(
                    "something this plugin did not mount is mounted at target_path {}: left alone",
                    target.display()
                )))
            }
            Some(true) => {
                if record.is_none() {
                    tracing::warn!(target = %target.display(), "unpublishing a mount with no record (state lost?)");
                }
                self.runner.unmount(&at).await.map_err(run_status)?;
            }
            None => {}
        }
        self.state.remove(&target).map_err(|e| internal("cannot forget the volume", e))?;
        match std::fs::remove_dir(&target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(target = %target.display(), error = %e, "cannot remove the target directory"),
        }
        tracing::info!(volume = %req.volume_id, target = %target.display(), "unpublished");
        Ok(())
    }

    /// After an upgrade of the program the mounts run: has every published mount's supervisor replace its
    /// worker by it, one mount after another (each pauses its readers for the takeover only).
    pub async fn upgrade_mounts(&self) {
        let records = match self.state.all() {
            Ok(r) => r,
            Err(e) => return tracing::error!(error = %e, "cannot list the published volumes to upgrade them"),
        };
        for r in records.iter().filter(|r| is_mountpoint(&resolved(&r.target))) {
            let _one = self.lock.lock().await;
            match self.runner.upgrade(&resolved(&r.target)).await {
                Ok(()) => tracing::info!(volume = %r.volume_id, target = %r.target.display(), "upgraded"),
                Err(e) => tracing::error!(volume = %r.volume_id, error = %e, "cannot upgrade the mount"),
            }
        }
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        self.publish(request.into_inner()).await.map(|()| Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        self.unpublish(request.into_inner()).await.map(|()| Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        // No stage/unstage (a mount per target), no volume stats, no expansion.
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities: Vec::new() }))
    }

    async fn node_get_info(&self, _: Request<NodeGetInfoRequest>) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}
