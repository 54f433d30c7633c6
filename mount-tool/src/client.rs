//! The network side of the mount, behind the [`BatchClient`] trait: the real HTTP/2 client
//! (`client/http.rs`: hyper over a few multiplexed connections to one or more servers, routed by each
//! server's health, `client/health.rs`), and, for tests (the unit tests, and with the `testing` feature
//! the e2e tests and benches), an in-memory server that can hand out wrong bodies (`client/memory.rs`) and
//! a client that fails on demand in front of any other (`client/faults.rs`). Bodies land in the buffers
//! of [`crate::buffers`].
//!
//! A client only moves bytes. Verifying sizes and checksums against the manifest, retrying and giving
//! up are the prefetcher's job, so the in-memory client can hand it wrong bytes on purpose.

use batchfs::api::{DatasetInfo, FileList, Manifest, SampleTable, SlotTable};
use batchfs::encode::BatchFormat;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

mod connect;
pub mod health;
mod http;
pub use crate::buffers::{Body, Sink};
pub use http::{parse_url, HttpClient, HttpConfig, UrlError};

/// What the server sends for one object: its size and CRC32C (from the manifest, or the file list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    pub bytes: u64,
    pub crc32c: u32,
}

/// A boxed future, as trait methods return.
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a request failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ClientError {
    #[error("cannot reach {server}: {message}")]
    Unreachable { server: String, message: String },
    #[error("{server} stalled: no bytes for {after:?}")]
    Stalled { server: String, after: Duration },
    #[error("{server} answered {status}: {message}")]
    Status { server: String, status: u16, message: String },
    #[error("{server} sent a malformed response: {message}")]
    Malformed { server: String, message: String },
    #[error("cannot store a body from {server}: {message}")]
    Store { server: String, message: String },
    /// A checkpoint of the body did not match the bytes before it (see [`crate::buffers::Partial`]).
    #[error("{server} sent a corrupt body: {message}")]
    Corrupt { server: String, message: String },
}

impl ClientError {
    /// The error of appending a body from `server` to its [`Sink`]: a checkpoint that did not match
    /// (`InvalidData`) is a corrupt body, anything else a store that failed.
    pub fn appending(server: &str, e: std::io::Error) -> Self {
        let (server, message) = (server.to_owned(), e.to_string());
        match e.kind() {
            std::io::ErrorKind::InvalidData => ClientError::Corrupt { server, message },
            _ => ClientError::Store { server, message },
        }
    }

    /// Whether trying again may help (network trouble, server errors), as opposed to a refusal that
    /// will not change (bad request, unknown dataset, token refused).
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Status { status, .. } => *status >= 500 || *status == 408 || *status == 429,
            _ => true,
        }
    }
}

/// Moves dataset descriptions, manifests and batch bodies.
pub trait BatchClient: Send + Sync + 'static {
    /// The dataset's description.
    fn dataset(&self) -> BoxFut<'_, Result<DatasetInfo, ClientError>>;
    /// The manifest of `epoch` in `format`.
    fn manifest(&self, epoch: u64, format: BatchFormat) -> BoxFut<'_, Result<Manifest, ClientError>>;
    /// One page of directory `dir` of the dataset's files, from `cursor` (0, or a page's `next`).
    fn files(&self, dir: &str, cursor: u64) -> BoxFut<'_, Result<FileList, ClientError>>;
    /// The slot table of `rolling/`'s fixed layout for the plan's TFRecord batches of epochs
    /// `first_epoch..first_epoch + epochs` (see [`batchfs::rolling`]).
    fn slot_table(&self, first_epoch: u64, epochs: u64) -> BoxFut<'_, Result<SlotTable, ClientError>>;
    /// The body of one batch (unverified), appended to `into` (an empty buffer with room for the whole
    /// body, usually reused memory, or an empty memory file), which is returned. `expect` is the size the
    /// manifest announced: a response that says or sends more is cut off with an error rather than
    /// buffered. `attempt` counts
    /// retries, so a client with several servers can try another one.
    fn fetch_batch(
        &self,
        epoch: u64,
        batch: u64,
        format: BatchFormat,
        attempt: u32,
        into: Sink,
        expect: u64,
    ) -> BoxFut<'_, Result<Body, ClientError>>;
    /// Every sample's label, data size and CRC32C (for `shuffled/`).
    fn sample_table(&self) -> BoxFut<'_, Result<SampleTable, ClientError>>;
    /// The data of samples `ids`, one after another (unverified), `expect` bytes, appended to `into` like
    /// [`BatchClient::fetch_batch`].
    fn fetch_samples(
        &self,
        ids: &[u32],
        attempt: u32,
        into: Sink,
        expect: u64,
    ) -> BoxFut<'_, Result<Body, ClientError>>;
    /// `expect` bytes of a source file from `offset` (unverified; a range request), appended to `into`
    /// like [`BatchClient::fetch_batch`].
    fn fetch_file(
        &self,
        path: &str,
        offset: u64,
        attempt: u32,
        into: Sink,
        expect: u64,
    ) -> BoxFut<'_, Result<Body, ClientError>>;
}

/// Shared handle to any client.
pub type DynClient = Arc<dyn BatchClient>;

#[cfg(any(test, feature = "testing"))]
mod memory;
#[cfg(any(test, feature = "testing"))]
pub use memory::{Fault, MemoryClient};
#[cfg(any(test, feature = "testing"))]
mod faults;
#[cfg(any(test, feature = "testing"))]
pub use faults::{Failure, FaultClient};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable() {
        let s = |status| ClientError::Status { server: "s".into(), status, message: String::new() };
        assert!(s(503).is_retryable() && s(429).is_retryable());
        assert!(!s(404).is_retryable() && !s(401).is_retryable() && !s(400).is_retryable());
        assert!(ClientError::Unreachable { server: "s".into(), message: String::new() }.is_retryable());
    }
}
