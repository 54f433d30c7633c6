//! batchfs mount: a read-only FUSE filesystem over a `batchfs-server` dataset, with planned prefetch.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod client;
pub mod prefetch;
pub mod stats;
pub mod sync;
