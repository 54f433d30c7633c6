//! An in-memory dataset server: fixed batch bodies per epoch, fetch counters, latency, bodies held midway,
//! and wrong bodies on demand (corrupt, short): what only the server of the bytes can get wrong.
//! Failures that send nothing are [`super::FaultClient`]'s, in front of it. Compiled for tests, and with
//! the `testing` feature.

use super::{BatchClient, Body, BodyFut, BoxFut, ClientError, Request, Sent, Sink};
use batchfs::api::{self, BatchEntry, DatasetInfo, FileList, Manifest, SampleTable, SlotTable};
use batchfs::encode::BatchFormat;
use bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// A wrong body the [`MemoryClient`] sends in answer to the next fetches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// The body with one byte flipped.
    Corrupt,
    /// The body one byte short.
    Short,
}

/// An in-memory dataset server for tests: fixed batch bodies per epoch, fetch counters, wrong bodies on
/// demand.
pub struct MemoryClient {
    info: DatasetInfo,
    /// Bodies by (epoch, format), batch-indexed.
    bodies: Box<dyn Fn(u64, BatchFormat) -> Vec<Bytes> + Send + Sync>,
    /// Source files, by path.
    pub files: Vec<(String, Bytes)>,
    /// The chunk size the file list gives (each file larger than one is checked chunk by chunk).
    pub chunk_bytes: u64,
    /// Entries per page of a file list (the server's paging, small).
    pub page: usize,
    /// The file-list pages asked for: (directory, cursor).
    pub listed: Mutex<Vec<(String, u64)>>,
    /// The sample ids of each data request.
    pub sampled: Mutex<Vec<Vec<u32>>>,
    /// The ranges of source files fetched: (path, offset, length).
    pub ranges: Mutex<Vec<(String, u64, u64)>>,
    faults: Mutex<Vec<Fault>>,
    /// Fetch calls made, successful or not.
    pub fetches: AtomicU64,
    /// Bytes of bodies sent, as each frame goes ([`BatchClient::received`]).
    pub received: AtomicU64,
    /// Artificial latency per fetch.
    pub delay: Mutex<Duration>,
    /// Batches whose fetches hang until they leave this set.
    pub held: Mutex<std::collections::HashSet<u64>>,
    /// Batches whose fetches send this many bytes, then hang until they leave this map.
    pub held_after: Mutex<std::collections::HashMap<u64, usize>>,
    /// Checkpoints sent with batch bodies: one every this many bytes (and the end); 0: none.
    pub checkpoint_every: std::sync::atomic::AtomicUsize,
    /// The index id every description, manifest, listing and table says (empty: none, as a server before
    /// index ids); a test sets another to index the dataset again under a mount.
    pub index_id: Mutex<String>,
    /// Bodies say `index_id` in their heads, as a server of this release does (the default): one asked for
    /// while it is not the expected one ([`BatchClient::expect_index`]) fails before any byte, as the HTTP
    /// client's does. Unset: as a server of a release before it.
    pub index_in_heads: std::sync::atomic::AtomicBool,
    /// The index expected of replies ([`BatchClient::expect_index`], the first one given; empty: any).
    expected: Mutex<String>,
}

impl MemoryClient {
    /// A client serving `bodies(epoch, format)`.
    pub fn new(bodies: impl Fn(u64, BatchFormat) -> Vec<Bytes> + Send + Sync + 'static) -> Self {
        MemoryClient {
            info: DatasetInfo {
                name: "memory".into(),
                format: batchfs::index::SourceFormat::Files,
                samples: 0,
                bytes: 0,
                shards: 0,
                classes: vec![],
                skipped: 0,
                slot_bytes: 0,
                mean_frame_bytes: 0,
                io: "mmap".into(),
                resident_bytes: 0,
                index_id: String::new(),
            },
            bodies: Box::new(bodies),
            files: Vec::new(),
            chunk_bytes: batchfs::index::CHUNK_BYTES,
            page: 2,
            listed: Mutex::new(Vec::new()),
            ranges: Mutex::new(Vec::new()),
            sampled: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
            fetches: AtomicU64::new(0),
            received: AtomicU64::new(0),
            delay: Mutex::new(Duration::ZERO),
            held: Mutex::new(Default::default()),
            held_after: Mutex::new(Default::default()),
            checkpoint_every: Default::default(),
            index_id: Mutex::default(),
            index_in_heads: std::sync::atomic::AtomicBool::new(true),
            expected: Mutex::default(),
        }
    }

    /// The index id it says now.
    fn index_id(&self) -> String {
        self.index_id.lock().expect("index id").clone()
    }

    /// Queues wrong bodies for the next fetches, in order.
    pub fn inject(&self, faults: impl IntoIterator<Item = Fault>) {
        self.faults.lock().expect("faults").extend(faults);
    }
}

impl BatchClient for MemoryClient {
    fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    fn dataset(&self) -> BoxFut<'_, Result<DatasetInfo, ClientError>> {
        Box::pin(async move {
            let (sorted, classes) = self.samples();
            let samples = sorted.len() as u64;
            Ok(DatasetInfo { classes, samples, index_id: self.index_id(), ..self.info.clone() })
        })
    }

    /// The first index given is kept, as the HTTP client keeps it: a mount plans with one.
    fn expect_index(&self, index_id: &str) {
        let mut expected = self.expected.lock().expect("expected index");
        if expected.is_empty() {
            *expected = index_id.to_owned();
        }
    }

    fn fetch_body(&self, request: &Request, _attempt: u32, into: Sink, expect: Sent) -> BodyFut<'_> {
        let (served, expected) = (self.index_id(), self.expected.lock().expect("expected index").clone());
        let compared = self.index_in_heads.load(Ordering::Relaxed) && !served.is_empty() && !expected.is_empty();
        if compared && served != expected {
            self.fetches.fetch_add(1, Ordering::Relaxed);
            let other = ClientError::OtherIndex { server: "memory".into(), index_id: served };
            return Box::pin(std::future::ready(Err(other)));
        }
        match request {
            Request::Batch { epoch, batch, format } => self.batch_body(*epoch, *batch, *format, into),
            Request::Samples(ids) => self.samples_body(ids, into),
            Request::File { path, offset } => self.file_body(path, *offset, into, expect.bytes),
        }
    }

    /// The files as the server indexes a file tree: sorted by path, each one sample, labelled by its first
    /// directory (classes sorted by name).
    fn sample_table(&self) -> BoxFut<'_, Result<SampleTable, ClientError>> {
        Box::pin(async move {
            let (sorted, classes) = self.samples();
            let mut t = SampleTable::default();
            for (path, body) in sorted {
                let class = path.split_once('/').and_then(|(c, _)| classes.iter().position(|x| x == c));
                t.labels.push(class.map_or(SampleTable::NO_LABEL, |c| c as u32));
                t.crc32c.push(batchfs::crc::crc32c(body));
                t.bytes.push(body.len() as u64);
            }
            Ok(SampleTable { index_id: self.index_id(), ..t })
        })
    }

    fn manifest(&self, epoch: u64, format: BatchFormat) -> BoxFut<'_, Result<Manifest, ClientError>> {
        Box::pin(async move {
            let bodies = (self.bodies)(epoch, format);
            let batches: Vec<BatchEntry> = bodies
                .iter()
                .enumerate()
                .map(|(i, b)| BatchEntry {
                    index: i as u64,
                    samples: 1,
                    bytes: b.len() as u64,
                    crc32c: batchfs::crc::crc32c(b),
                })
                .collect();
            Ok(Manifest {
                dataset: "memory".into(),
                epoch,
                options: Default::default(),
                format,
                samples: batches.len() as u64,
                bytes: batches.iter().map(|b| b.bytes).sum(),
                batches,
                index_id: self.index_id(),
            })
        })
    }

    /// Pages of `page` entries as the server makes them: `files` sorted by path, a subdirectory one
    /// entry, the cursor a position in the sorted list.
    fn files(&self, dir: &str, cursor: u64) -> BoxFut<'_, Result<FileList, ClientError>> {
        let dir = dir.to_owned();
        Box::pin(async move {
            self.fetches.fetch_add(1, Ordering::Relaxed);
            self.listed.lock().expect("listed").push((dir.clone(), cursor));
            let mut sorted: Vec<&(String, Bytes)> = self.files.iter().collect();
            sorted.sort_by(|a, b| a.0.cmp(&b.0));
            let prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
            let chunk = self.chunk_bytes as usize;
            let (mut dirs, mut files) = (Vec::new(), Vec::new());
            let mut at = cursor as usize;
            while at < sorted.len() && dirs.len() + files.len() < self.page {
                let (path, b) = sorted[at];
                at += 1;
                let Some(rest) = path.strip_prefix(&prefix) else { continue };
                match rest.split_once('/') {
                    Some((sub, _)) => {
                        if dirs.last() != Some(&sub.to_owned()) {
                            dirs.push(sub.to_owned());
                        }
                    }
                    None => files.push(api::FileEntry {
                        path: path.clone(),
                        size: b.len() as u64,
                        crc32c: batchfs::crc::crc32c(b),
                        chunks: if b.len() > chunk {
                            b.chunks(chunk).map(batchfs::crc::crc32c).collect()
                        } else {
                            vec![]
                        },
                        // The files are the samples, in path order.
                        sample: Some(at as u32 - 1),
                    }),
                }
            }
            let next = (at < sorted.len()).then_some(at as u64);
            Ok(FileList { chunk_bytes: self.chunk_bytes, dir, dirs, files, next, index_id: self.index_id() })
        })
    }

    /// The table as the server computes it, from the TFRecord frames of each epoch's bodies.
    fn slot_table(&self, first_epoch: u64, epochs: u64) -> BoxFut<'_, Result<SlotTable, ClientError>> {
        Box::pin(async move {
            let mut batches: Vec<Vec<u64>> = Vec::new();
            for epoch in first_epoch..first_epoch + epochs {
                for (b, body) in (self.bodies)(epoch, BatchFormat::Tfrecord).iter().enumerate() {
                    let Some(frames) = batchfs::rolling::frames_of(body) else {
                        let message = format!("batch {b} of epoch {epoch} is not TFRecord frames");
                        return Err(ClientError::Malformed { server: "memory".into(), message });
                    };
                    let mut sizes: Vec<u64> = frames.into_iter().map(|(_, len)| len).collect();
                    sizes.sort_unstable_by(|a, b| b.cmp(a));
                    if batches.len() <= b {
                        batches.push(vec![0; sizes.len()]);
                    }
                    for (slot, size) in batches[b].iter_mut().zip(sizes) {
                        *slot = (*slot).max(size);
                    }
                }
            }
            Ok(SlotTable { options: Default::default(), first_epoch, epochs, batches, index_id: self.index_id() })
        })
    }
}

impl MemoryClient {
    /// Samples `ids`' data, one after another.
    fn samples_body(&self, ids: &[u32], into: Sink) -> BodyFut<'_> {
        self.sampled.lock().expect("sampled").push(ids.to_vec());
        let (sorted, _) = self.samples();
        let body = ids.iter().map(|&i| sorted.get(i as usize).map(|(_, b)| b.clone())).collect::<Option<Vec<Bytes>>>();
        let body = body.map(|parts| Bytes::from(parts.concat()));
        Box::pin(self.serve(body, into, None))
    }

    /// Batch `batch` of `epoch` in `format` (once no test holds it).
    fn batch_body(&self, epoch: u64, batch: u64, format: BatchFormat, into: Sink) -> BodyFut<'_> {
        Box::pin(async move {
            while self.held.lock().expect("held").contains(&batch) {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            self.serve((self.bodies)(epoch, format).get(batch as usize).cloned(), into, Some(batch)).await
        })
    }

    /// `expect` bytes of file `path` from `offset`.
    fn file_body(&self, path: &str, offset: u64, into: Sink, expect: u64) -> BodyFut<'_> {
        self.ranges.lock().expect("ranges").push((path.to_owned(), offset, expect));
        let body = self.files.iter().find(|(p, _)| p == path).map(|(_, b)| {
            let start = (offset as usize).min(b.len());
            b.slice(start..(start + expect as usize).min(b.len()))
        });
        Box::pin(self.serve(body, into, None))
    }

    /// The files sorted by path, and the class names (the first directories, sorted).
    fn samples(&self) -> (Vec<&(String, Bytes)>, Vec<String>) {
        let mut sorted: Vec<&(String, Bytes)> = self.files.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        let classes: std::collections::BTreeSet<String> =
            sorted.iter().filter_map(|(p, _)| p.split_once('/').map(|(c, _)| c.to_owned())).collect();
        (sorted, classes.into_iter().collect())
    }

    /// Answers with `body` (404 when absent) appended to `into` in 1,000-byte frames, after the delay and
    /// any queued fault; a batch's body comes with checkpoints (`checkpoint_every`) and may hang midway
    /// (`held_after`).
    async fn serve(&self, body: Option<Bytes>, mut into: Sink, batch: Option<u64>) -> Result<Body, ClientError> {
        self.fetches.fetch_add(1, Ordering::Relaxed);
        let delay = *self.delay.lock().expect("delay");
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let fault = {
            let mut faults = self.faults.lock().expect("faults");
            (!faults.is_empty()).then(|| faults.remove(0))
        };
        let server = "memory".to_owned();
        let Some(body) = body else {
            return Err(ClientError::Status { server, status: 404, message: "no such file".into() });
        };
        let mut sent = body.to_vec();
        match fault {
            Some(Fault::Corrupt) => {
                if let Some(b) = sent.first_mut() {
                    *b ^= 1;
                }
            }
            Some(Fault::Short) => {
                sent.pop();
            }
            None => {}
        }
        let every = batch.map_or(0, |_| self.checkpoint_every.load(Ordering::Relaxed));
        if every > 0 {
            let ends = (every..body.len()).step_by(every).chain([body.len()]).filter(|&e| e > 0);
            into.expect_checkpoints(ends.map(|e| (e as u64, batchfs::crc::crc32c(&body[..e]))).collect());
        }
        let mut crc = 0;
        for (i, frame) in sent.chunks(1000).enumerate() {
            while batch.is_some_and(|b| self.held_after.lock().expect("held").get(&b).is_some_and(|&n| i * 1000 >= n)) {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            into.append(&bytes::Bytes::copy_from_slice(frame), &mut crc)
                .map_err(|e| ClientError::appending(&server, e))?;
            self.received.fetch_add(frame.len() as u64, Ordering::Relaxed);
            if every > 0 {
                // Frames arrive one by one: readers may find the body part verified, part on its way.
                tokio::task::yield_now().await;
            }
        }
        Ok(Body { sink: into, crc32c: crc })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first index a client is told is the one it expects, as the HTTP client's: none given (empty)
    /// sets nothing, and a later one replaces nothing (a mount plans with one index).
    #[test]
    fn the_first_index_expected_is_kept() {
        let client = MemoryClient::new(|_, _| Vec::new());
        client.expect_index("");
        client.expect_index("0000000000000001");
        client.expect_index("0000000000000002");
        assert_eq!(*client.expected.lock().unwrap(), "0000000000000001");
    }
}
