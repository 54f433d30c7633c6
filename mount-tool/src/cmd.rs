//! The side tools of the `batchfs` CLI, apart from the filesystem: `demo` (generate, serve, mount, read,
//! report), `bench` (read a tree as a loader does), `netem` (a delay-line and rate-cap TCP proxy for
//! loopback links) and `energy` (a command's energy per sensor, idle baseline subtracted).

pub mod bench;
pub mod demo;
pub mod energy;
pub mod netem;
