//! Inode numbers encode what they name, so no table grows with the epochs read, and a new process serving
//! the same mount numbers everything the same way (a worker taking over keeps the kernel's inodes). The
//! root is 1; every other number is one view's, decoded by that view, in ranges that never meet (a
//! property test in `fs.rs` checks it):
//!
//! - `meta`: `.batchfs` is 2, its `stats` 3.
//! - `rolling`: `rolling/` is 4; as it serves epoch *e*, name *b* is `2^62 + e·2^36 + b·8 + kind` (kind
//!   2 the packed batch, 3 its index, 4 the indexed layout's file); the indexed layout's twin of name
//!   *b*, one file for every epoch, is `2^43 + b`.
//! - `shuffled`: `shuffled/` is 5, its class folder *c* `2^44 + c`, and sample *k* of class *c* in epoch
//!   *e* `2^61 + e·2^41 + c·2^24 + k`.
//! - `epochs`: epoch directory *e* is `2^40 + e`, its batch *b* `2^62 + e·2^36 + b·8 + kind` (kind 0 the
//!   batch, 1 its DALI index).
//! - `raw`: node *n* of the `raw/` tree (built from the server's file list on first use) is `2^41 + n`
//!   for a directory, `2^42 + n` for a file.

/// The root directory.
pub const ROOT: u64 = 1;
