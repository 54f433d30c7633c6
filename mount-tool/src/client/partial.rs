//! A body buffer that readers may read from while it is still arriving: only its verified prefix.
//!
//! A batch response carries its checkpoints (`x-batchfs-checkpoints`: the CRC32C of every byte before
//! each of a few points, computed by the server from the index, like the manifest's CRC). The fetch
//! writes the body into a [`Partial`] through a [`Sink`](super::Sink), keeps the CRC32C of what arrived,
//! and at each checkpoint compares the two: equal, the prefix is *verified* and readers may copy from it;
//! different, the attempt fails at once (and is retried) with nothing past the last verified point
//! released. The checkpoints are only used when the last one is the size and CRC32C the manifest
//! announced, so no byte reaches a reader that the manifest does not vouch for. The whole body is still
//! checked against the manifest at the end.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

/// A body being fetched: its buffer and how much of it is verified.
pub struct Partial {
    buf: RwLock<Vec<u8>>,
    /// Bytes of `buf` verified by a checkpoint: readers may copy `[0, verified)`. Stored after the bytes
    /// are written (release), loaded before they are read (acquire).
    verified: AtomicU64,
    /// The size and CRC32C the manifest announced.
    expect: (u64, u32),
    /// Called after each verified prefix is published (wakes the readers waiting for it).
    on_verified: Box<dyn Fn() + Send + Sync>,
}

impl Partial {
    /// An empty body of `expect.0` bytes with CRC32C `expect.1`, filling `buffer` (emptied, capacity
    /// reserved); `on_verified` runs whenever more of it is verified.
    pub fn new(mut buffer: Vec<u8>, expect: (u64, u32), on_verified: impl Fn() + Send + Sync + 'static) -> Self {
        buffer.clear();
        buffer.reserve_exact(expect.0 as usize);
        Partial { buf: RwLock::new(buffer), verified: AtomicU64::new(0), expect, on_verified: Box::new(on_verified) }
    }

    /// Bytes verified so far.
    pub fn verified(&self) -> u64 {
        self.verified.load(Ordering::Acquire)
    }

    /// A copy of `range` if all of it is verified (and the buffer not yet taken).
    pub fn copy(&self, range: std::ops::Range<u64>) -> Option<bytes::Bytes> {
        if range.end > self.verified() {
            return None;
        }
        let buf = self.buf.read().expect("partial body");
        let bytes = buf.get(range.start as usize..range.end as usize)?;
        Some(bytes::Bytes::copy_from_slice(bytes))
    }

    /// The buffer, once the body is complete (readers get `None` from [`Partial::copy`] from now on).
    pub fn take(&self) -> Vec<u8> {
        let mut buf = self.buf.write().expect("partial body");
        self.verified.store(0, Ordering::Release);
        std::mem::take(&mut *buf)
    }

    fn write(&self, data: &[u8]) {
        self.buf.write().expect("partial body").extend_from_slice(data);
    }

    fn publish(&self, end: u64) {
        self.verified.store(end, Ordering::Release);
        (self.on_verified)();
    }
}

/// The writing side of a [`Partial`], owned by one fetch attempt: the checkpoints still ahead.
pub struct Filling {
    pub partial: std::sync::Arc<Partial>,
    written: u64,
    checkpoints: std::collections::VecDeque<(u64, u32)>,
}

impl Filling {
    pub fn new(partial: std::sync::Arc<Partial>) -> Self {
        Filling { partial, written: 0, checkpoints: Default::default() }
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.written
    }

    /// Whether nothing was written yet.
    pub fn is_empty(&self) -> bool {
        self.written == 0
    }

    /// Uses `checkpoints` (from the response, before its first byte) if they end at the manifest's size
    /// and CRC32C and lie within the body; otherwise the body is released only whole. Returns whether
    /// they are used.
    pub fn expect_checkpoints(&mut self, checkpoints: Vec<(u64, u32)>) -> bool {
        let fits = self.written == 0 && checkpoints.last() == Some(&self.partial.expect);
        if fits {
            self.checkpoints = checkpoints.into();
        }
        fits
    }

    /// Appends `data`, extending `crc` (the CRC32C of everything written before) over it; at each
    /// checkpoint reached, publishes the prefix if `crc` matches it, and fails with `InvalidData` if not.
    pub fn append(&mut self, mut data: &[u8], crc: &mut u32) -> std::io::Result<()> {
        while !data.is_empty() {
            let next = self.checkpoints.front().copied();
            let take = next.map_or(data.len(), |(end, _)| ((end - self.written) as usize).min(data.len()));
            let (now, rest) = data.split_at(take);
            *crc = crc32c::crc32c_append(*crc, now);
            self.partial.write(now);
            self.written += take as u64;
            data = rest;
            if let Some((end, want)) = next.filter(|&(end, _)| end == self.written) {
                if *crc != want {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "the body's first {end} bytes have CRC32C {:08x}, its checkpoint says {want:08x}",
                            *crc
                        ),
                    ));
                }
                self.checkpoints.pop_front();
                self.partial.publish(end);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn partial_of(body: &[u8]) -> Arc<Partial> {
        Arc::new(Partial::new(Vec::new(), (body.len() as u64, crc32c::crc32c(body)), || {}))
    }

    fn checkpoints(body: &[u8], every: usize) -> Vec<(u64, u32)> {
        let mut ends: Vec<usize> = (every..body.len()).step_by(every).collect();
        ends.push(body.len());
        ends.into_iter().map(|e| (e as u64, crc32c::crc32c(&body[..e]))).collect()
    }

    proptest! {
        /// Whatever the frames, only verified prefixes are readable, each is exactly the body's, and a
        /// flipped byte fails its checkpoint's frame before anything from that checkpoint on is released.
        #[test]
        fn only_verified_prefixes_are_released(
            body in proptest::collection::vec(any::<u8>(), 1..5_000),
            every in 1usize..1_000,
            frame in 1usize..700,
            flip in proptest::option::of(any::<proptest::sample::Index>()),
        ) {
            let p = partial_of(&body);
            let mut f = Filling::new(p.clone());
            prop_assert!(f.expect_checkpoints(checkpoints(&body, every)));
            let mut sent = body.clone();
            let flipped = flip.map(|i| i.index(body.len()));
            if let Some(i) = flipped {
                sent[i] ^= 0x40;
            }
            let mut crc = 0;
            let mut failed = false;
            for piece in sent.chunks(frame) {
                let before = p.verified();
                if f.append(piece, &mut crc).is_err() {
                    failed = true;
                    break;
                }
                let now = p.verified();
                prop_assert!(now >= before);
                prop_assert_eq!(p.copy(0..now).unwrap(), &body[..now as usize]);
                prop_assert!(p.copy(0..now + 1).is_none());
                if let Some(i) = flipped {
                    prop_assert!(now <= i as u64);
                }
            }
            prop_assert_eq!(failed, flipped.is_some());
            if !failed {
                prop_assert_eq!(p.verified(), body.len() as u64);
                prop_assert_eq!(crc, crc32c::crc32c(&body));
                prop_assert_eq!(p.take(), body);
                prop_assert!(p.copy(0..1).is_none());
            }
        }
    }

    #[test]
    fn checkpoints_that_do_not_end_at_the_manifests_body_are_not_used() {
        let body = vec![7u8; 100];
        let mut f = Filling::new(partial_of(&body));
        assert!(!f.expect_checkpoints(vec![(50, crc32c::crc32c(&body[..50])), (100, 0)]));
        assert!(!f.expect_checkpoints(vec![(50, crc32c::crc32c(&body[..50]))]));
        let mut crc = 0;
        f.append(&body, &mut crc).unwrap();
        assert_eq!(f.partial.verified(), 0, "without checkpoints nothing is released before the end");
        let mut late = Filling::new(partial_of(&body));
        late.append(&body[..10], &mut 0).unwrap();
        assert!(!late.expect_checkpoints(checkpoints(&body, 50)), "checkpoints come before the first byte");
    }
}
