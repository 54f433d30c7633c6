//! batchfs core: sample sources and their index, epoch planning, batch encodings, the wire API and the
//! synthetic dataset generator, shared by `batchfs-server` and the `batchfs` mount.
//!
//! Nothing here knows about HTTP servers or FUSE.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod api;
pub mod atomic;
pub mod crc;
pub mod demo;
pub mod encode;
pub mod fd;
pub mod frames;
pub mod gen;
pub mod hpack;
pub mod index;
pub mod mmap;
pub mod plan;
pub mod process;
pub mod prometheus;
pub mod proto;
pub mod rolling;
pub mod source;
pub mod tar;
pub mod tfrecord;
pub mod units;
