//! The network side of the mount, behind the [`BatchClient`] trait: the real HTTP/2 client
//! (`client/http.rs`: a few multiplexed connections to one or more servers, routed by each server's
//! health, `client/health.rs`, each speaking HTTP/2 by `client/wire.rs`: bodies and the JSON replies
//! alike), and, for tests (the unit tests, and with the `testing` feature
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
mod recheck;
mod tls;
mod wire;
pub use crate::buffers::{Body, Sink};
pub use http::{check_url_parts, parse_url, HttpClient, HttpConfig, UrlError};
pub use tls::HandshakeError;

/// What the server sends for one object: its size and CRC32C (from the manifest, or the file list).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sent {
    pub bytes: u64,
    pub crc32c: u32,
}

impl Sent {
    /// What is wrong with `body` where it is not this object (its size or CRC32C), if anything: "N bytes
    /// with CRC32C X, where M bytes with Y were announced".
    pub fn mismatch(&self, body: &Body) -> Option<String> {
        let (len, crc) = (body.sink.len(), body.crc32c);
        (len != self.bytes || crc != self.crc32c).then(|| {
            format!(
                "{len} bytes with CRC32C {crc:08x}, where {} bytes with {:08x} were announced",
                self.bytes, self.crc32c
            )
        })
    }
}

/// A boxed future, as trait methods return.
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
/// A fetched body, as the client's futures give it.
pub type BodyFut<'a> = BoxFut<'a, Result<Body, ClientError>>;

/// Why a request failed.
#[derive(Debug, Error, Clone)]
pub enum ClientError {
    /// The server could not be reached, or the connection failed under a response: the transport's
    /// error (its chain in the message).
    #[error("cannot reach {server}: {}", chain(cause.as_ref()))]
    Unreachable { server: String, cause: Cause },
    #[error("{server} stalled: no bytes for {after:?}")]
    Stalled { server: String, after: Duration },
    /// The server's answer: its status and what its body said.
    #[error("{server} answered {status}: {message}")]
    Status { server: String, status: u16, message: String },
    /// What is wrong with the response.
    #[error("{server} sent a malformed response: {message}")]
    Malformed { server: String, message: String },
    /// The body could not be stored where it was going (its buffer or memory file): the I/O error.
    #[error("cannot store a body from {server}: {cause}")]
    Store { server: String, cause: Arc<std::io::Error> },
    /// A checkpoint of the body did not match the bytes before it (see [`crate::buffers::Partial`]).
    #[error("{server} sent a corrupt body: {cause}")]
    Corrupt { server: String, cause: Arc<std::io::Error> },
    /// The reply's head said another index of the dataset ([`batchfs::api::INDEX_ID_HEADER`]) than the one
    /// the client expects ([`BatchClient::expect_index`]), and every server is known to serve another: none
    /// of its bytes was taken. The dataset was indexed again there with other files; no retry mends it.
    #[error("{server} serves index {index_id} of the dataset, indexed again with other files")]
    OtherIndex { server: String, index_id: String },
    /// The reply's head said another index, as for [`ClientError::OtherIndex`], but a server not known to
    /// serve another may still serve the expected one (it was out of rotation, or rested, while the request
    /// tried the others): none of its bytes was taken, and a retry may find that server back.
    #[error(
        "{server} serves index {index_id} of the dataset, indexed again with other files; the servers that may \
         serve the mount's index are out of rotation for now"
    )]
    OthersOut { server: String, index_id: String },
}

/// A transport's error, shared: a failed fetch's error reaches every reader waiting on it. Kept as it
/// came (downcast it to ask what it was), not as its text; the message shows its chain.
pub type Cause = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// `e` and its sources, `: `-separated.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

impl ClientError {
    /// The error of appending a body from `server` to its [`Sink`]: a checkpoint that did not match
    /// (`InvalidData`) is a corrupt body, anything else a store that failed.
    pub fn appending(server: &str, e: std::io::Error) -> Self {
        let server = server.to_owned();
        match e.kind() {
            std::io::ErrorKind::InvalidData => ClientError::Corrupt { server, cause: Arc::new(e) },
            _ => ClientError::Store { server, cause: Arc::new(e) },
        }
    }

    /// `server` unreachable for `cause`.
    pub fn unreachable(server: impl Into<String>, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        ClientError::Unreachable { server: server.into(), cause: Arc::new(cause) }
    }

    /// Whether trying again may help (network trouble, server errors), as opposed to a refusal that
    /// will not change (bad request, unknown dataset, token refused).
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Status { status, .. } => *status >= 500 || *status == 408 || *status == 429,
            ClientError::OtherIndex { .. } => false,
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
    /// The body `request` names (unverified), appended to `into` (an empty buffer with room for the whole
    /// body, usually reused memory, or an empty memory file), which is returned. `expect` is the size and
    /// CRC32C the manifest (or the sample or file table) announced: a response that says or sends more is
    /// cut off with an error rather than buffered, and one whose bytes differ is [`ClientError::Corrupt`]
    /// where the client can tell (the HTTP client: counted against the server that sent it). `attempt`
    /// counts retries, so a client with several servers can try another one.
    fn fetch_body(&self, request: &Request, attempt: u32, into: Sink, expect: Sent) -> BodyFut<'_>;
    /// Every sample's label, data size and CRC32C (for `shuffled/`).
    fn sample_table(&self) -> BoxFut<'_, Result<SampleTable, ClientError>>;
    /// Bytes of responses received so far, every server together, counted as they arrive (not when a
    /// response ends): while it moves the link is busy, not down, and a read waits on past `timeout`.
    /// 0 for a client that cannot tell.
    fn received(&self) -> u64 {
        0
    }
    /// From now on, replies whose head names another index of the dataset than `index_id` (the one the
    /// mount planned with) are refused as their head arrives, before any byte of their body is taken: the
    /// request goes to another server that may still serve `index_id` (waiting for one out of rotation or
    /// resting), and where every server is known to serve another fails with [`ClientError::OtherIndex`].
    /// A reply that names no index (a server of a release before it) is taken as it is. Empty: nothing
    /// compared (the default); a client keeps the first index it is given.
    fn expect_index(&self, _index_id: &str) {}
}

/// Which body to fetch: what the server sends for one object a mount shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Batch `batch` of `epoch` in `format`.
    Batch { epoch: u64, batch: u64, format: BatchFormat },
    /// The data of samples `ids`, one after another (a group of `shuffled/`, warming's batches).
    Samples(Arc<[u32]>),
    /// A source file's bytes from `offset` (a range request: a chunk of a file of `raw/`).
    File { path: String, offset: u64 },
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
        assert!(ClientError::unreachable("s", std::io::Error::other("refused")).is_retryable());
        let (server, index_id) = (String::from("s"), String::from("2"));
        assert!(!ClientError::OtherIndex { server: server.clone(), index_id: index_id.clone() }.is_retryable());
        assert!(ClientError::OthersOut { server, index_id }.is_retryable(), "a server of the index may be back");
    }

    #[test]
    fn a_transport_error_is_kept_as_it_came_and_its_chain_is_the_message() {
        #[derive(Debug, Error)]
        #[error("connect failed")]
        struct Connect(#[source] std::io::Error);
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let e = ClientError::unreachable("http://a:1", Connect(refused));
        assert_eq!(e.to_string(), "cannot reach http://a:1: connect failed: connection refused");
        let ClientError::Unreachable { cause, .. } = e.clone() else { panic!("{e}") };
        let connect = cause.downcast_ref::<Connect>().expect("the transport's own error");
        assert_eq!(connect.0.kind(), std::io::ErrorKind::ConnectionRefused);
        let stored = ClientError::appending("s", std::io::Error::new(std::io::ErrorKind::InvalidData, "checkpoint 2"));
        assert!(
            matches!(&stored, ClientError::Corrupt { cause, .. } if cause.kind() == std::io::ErrorKind::InvalidData)
        );
        let full = ClientError::appending("s", std::io::Error::from(std::io::ErrorKind::StorageFull));
        assert!(matches!(&full, ClientError::Store { cause, .. } if cause.kind() == std::io::ErrorKind::StorageFull));
    }
}
