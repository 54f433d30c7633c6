//! Every lock, condition variable and atomic the prefetcher and cache use comes from here, so a model
//! checker (loom, shuttle) can be swapped in for `std::sync` in one place.

pub use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};
