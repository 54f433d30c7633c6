//! A client that fails on demand in front of any other (the in-memory one, or the real HTTP client
//! against a real server): each fetch takes the next queued [`Failure`], if any. Descriptions, manifests
//! and lists pass through. Compiled for tests, and with the `testing` feature.

use super::{BatchClient, BodyFut, BoxFut, ClientError, Request, Sent, Sink};
use batchfs::api::{DatasetInfo, FileList, Manifest, SampleTable, SlotTable};
use batchfs::encode::BatchFormat;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// What one fetch meets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Nothing: the fetch goes through (to script a failure after some that succeed).
    Pass,
    /// Fail as if the server were unreachable, sending nothing.
    Unreachable,
    /// Answer with this HTTP status, sending nothing.
    Status(u16),
    /// Wait this long, then go through.
    Delay(Duration),
}

/// `C` with failures on demand.
pub struct FaultClient<C> {
    inner: C,
    queue: Mutex<VecDeque<Failure>>,
    /// Fetches failed here.
    pub failed: AtomicU64,
}

impl<C> FaultClient<C> {
    pub fn new(inner: C) -> Self {
        FaultClient { inner, queue: Mutex::new(VecDeque::new()), failed: AtomicU64::new(0) }
    }

    /// The client behind the failures.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// Queues failures for the next fetches, in order.
    pub fn fail_next(&self, failures: impl IntoIterator<Item = Failure>) {
        self.queue.lock().expect("failures").extend(failures);
    }

    /// Drops the failures still queued: the next fetches go through.
    pub fn heal(&self) {
        self.queue.lock().expect("failures").clear();
    }

    /// The next fetch's failure: an error to answer with, after any delay.
    async fn next(&self) -> Result<(), ClientError> {
        let failure = self.queue.lock().expect("failures").pop_front();
        let server = "fault-client".to_owned();
        let err = match failure {
            None | Some(Failure::Pass) => return Ok(()),
            Some(Failure::Delay(d)) => {
                tokio::time::sleep(d).await;
                return Ok(());
            }
            Some(Failure::Unreachable) => ClientError::unreachable(server, std::io::Error::other("injected")),
            Some(Failure::Status(status)) => ClientError::Status { server, status, message: "injected".into() },
        };
        self.failed.fetch_add(1, Ordering::Relaxed);
        Err(err)
    }
}

impl<C> std::ops::Deref for FaultClient<C> {
    type Target = C;

    fn deref(&self) -> &C {
        &self.inner
    }
}

impl<C: BatchClient> BatchClient for FaultClient<C> {
    fn dataset(&self) -> BoxFut<'_, Result<DatasetInfo, ClientError>> {
        self.inner.dataset()
    }

    fn manifest(&self, epoch: u64, format: BatchFormat) -> BoxFut<'_, Result<Manifest, ClientError>> {
        self.inner.manifest(epoch, format)
    }

    fn files(&self, dir: &str, cursor: u64) -> BoxFut<'_, Result<FileList, ClientError>> {
        self.inner.files(dir, cursor)
    }

    fn slot_table(&self, first_epoch: u64, epochs: u64) -> BoxFut<'_, Result<SlotTable, ClientError>> {
        self.inner.slot_table(first_epoch, epochs)
    }

    fn received(&self) -> u64 {
        self.inner.received()
    }

    fn expect_index(&self, index_id: &str) {
        self.inner.expect_index(index_id)
    }

    fn fetch_body(&self, request: &Request, attempt: u32, into: Sink, expect: Sent) -> BodyFut<'_> {
        let request = request.clone();
        Box::pin(async move {
            self.next().await?;
            self.inner.fetch_body(&request, attempt, into, expect).await
        })
    }

    fn sample_table(&self) -> BoxFut<'_, Result<SampleTable, ClientError>> {
        self.inner.sample_table()
    }
}
