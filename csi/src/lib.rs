//! batchfs-csi: a CSI node plugin that mounts batchfs datasets into Kubernetes pods (docs/DEPLOYMENT.md).
//!
//! The kubelet calls the plugin over a unix socket (gRPC, CSI v1): [`identity`] answers who it is,
//! [`node`] publishes a volume (a batchfs mount at the pod's target path) and unpublishes it. A volume's
//! attributes are the dataset's `url` and the mount's `options` (the `-o` string of `batchfs mount`, parsed
//! by the same code); its token comes from the node-publish secret ([`volume`]).
//!
//! **Mounts that outlive the plugin.** The plugin holds no mount. Each volume is one supervised `batchfs
//! mount` (a supervisor holding the FUSE connection, a worker serving it: `supervise.rs` of the mount),
//! started by a [`runner::Runner`]: by the plugin itself (outside a container), or by the holder
//! (`batchfs-csi holder`), a small long-lived process in a container of its own that only starts,
//! unmounts and upgrades mounts when the plugin asks ([`holder`]). Killing or upgrading the plugin's
//! process or container leaves every mount served; what the plugin must remember across its restarts
//! (which volume is published where, with which attributes) is in its state directory.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod cli;
pub mod holder;
pub mod identity;
pub mod node;
pub mod plugin;
pub mod runner;
pub mod socket;
pub mod volume;

/// The CSI v1 messages and services the plugin serves (compiled from `proto/csi.proto`).
#[allow(clippy::all, missing_docs)]
pub mod proto {
    tonic::include_proto!("csi.v1");
}

/// The driver's name, as the `CSIDriver` object and the volumes' `driver` field name it.
pub const DRIVER_NAME: &str = "csi.batchfs.io";
