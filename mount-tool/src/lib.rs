//! batchfs mount: a read-only FUSE filesystem over a `batchfs-server` dataset, with planned prefetch.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod buffers;
pub mod cli;
pub mod client;
pub mod fs;
pub mod fuse;
pub mod ledger;
pub mod metrics;
pub mod mount;
pub mod node_cache;
pub mod options;
pub mod plan;
pub mod prefetch;
pub mod stats;
pub mod supervise;
pub mod sync;
pub mod sys;
pub mod warm;
