//! The locks, condition variables and atomics of the prefetcher and its cache (`prefetch.rs` and
//! `prefetch/`), of the buffer pool, of `rolling/`'s counters (`fs/views/rolling/state.rs`), of the node cache and of
//! the stats' counters come from here: `std::sync`'s, or with the `shuttle` feature the Shuttle model
//! checker's, whose scheduler runs the model tests of the cache and the window (`prefetch/cache.rs` and
//! `prefetch/window.rs`, `shuttle_` tests) through
//! many interleavings of their threads and reports a deadlock or a lost wakeup (its condition variables
//! never time out, so a wait nobody notifies is a deadlock there). The `OnceLock`s, and the locks of the
//! filesystem's handles, `raw/` and `shuffled/` tables (`fs/`), of the FUSE adapter and of the supervisor
//! use `std::sync` directly.

#[cfg(not(feature = "shuttle"))]
pub use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(not(feature = "shuttle"))]
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};

#[cfg(feature = "shuttle")]
pub use shuttle::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(feature = "shuttle")]
pub use shuttle::sync::{Arc, Condvar, Mutex, MutexGuard};
