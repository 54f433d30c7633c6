//! batchfs mount: a read-only FUSE filesystem over a `batchfs-server` dataset, with planned prefetch.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod bench;
pub mod cli;
pub mod client;
pub mod demo;
pub mod energy_cmd;
pub mod fs;
pub mod fuse;
pub mod mount;
pub mod netem;
pub mod options;
pub mod pool;
pub mod prefetch;
pub mod stats;
pub mod sync;
pub mod sys;
