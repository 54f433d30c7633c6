//! End-to-end tests: the real server on generated datasets, read over real HTTP/2 connections.

mod changed;
mod chaos;
mod common;
mod csi;
mod failover;
mod faults;
mod house;
mod loaders;
mod mount;
mod narrow;
mod netem;
mod node_cache;
mod objects;
mod raw;
mod rolling;
mod server;
mod shuffled;
mod takeover;
mod uring;
