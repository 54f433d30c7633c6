//! The locks, condition variables and atomics of the prefetcher and its cache (`prefetch.rs` and
//! `prefetch/`), of `rolling/`'s counters (`fs/rolling.rs`), of the node cache and of the stats' counters
//! come from here, so that a model checker (loom, shuttle) could be swapped in for `std::sync` in one
//! place. None is run yet. The `OnceLock`s, and the locks of the filesystem's handles, `raw/` and
//! `shuffled/` tables (`fs/`), of the FUSE adapter and of the supervisor use `std::sync` directly.

pub use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};
