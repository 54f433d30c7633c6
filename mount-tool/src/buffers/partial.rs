//! A body buffer that readers may read from while it is still arriving: only its verified prefix, and
//! without a copy. One of the few modules of the mount with `unsafe` code (docs/DESIGN.md lists them).
//!
//! A batch response carries its checkpoints (`x-batchfs-checkpoints`: the CRC32C of every byte before
//! each of a few points, computed by the server from the index, like the manifest's CRC). The fetch
//! writes the body into a [`Partial`] through a [`Sink`](super::Sink), keeps the CRC32C of what arrived,
//! and at each checkpoint compares the two: equal, the prefix is *verified* and readers may read it;
//! different, the attempt fails at once (and is retried) with nothing past the last verified point
//! released. The checkpoints are only used when the last one is the size and CRC32C the manifest
//! announced, so no byte reaches a reader that the manifest does not vouch for. The whole body is still
//! checked against the manifest at the end.

use super::pool::BufferPool;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// A body being fetched: its buffer, written by one [`Filling`] and read up to what is verified.
///
/// Readers get their bytes without a copy, as views of the buffer ([`Partial::slice`]), the whole body
/// too once complete ([`Filling::finish`]). The buffer is not a `Vec` while it is shared: the writer
/// appends past the verified prefix while readers hold slices of it, which `&mut Vec` cannot allow. The
/// buffer never moves or grows (its capacity is reserved for the manifest's size), and goes back to the
/// pool when the last view and the writer are gone.
pub struct Partial {
    /// The allocation of the `Vec` this body was given: `cap` bytes, of which the writer has initialized a
    /// prefix (`Filling::written`).
    ptr: NonNull<u8>,
    cap: usize,
    /// Bytes verified: readers may view `[0, verified)`, and nothing writes there again. Stored after
    /// the bytes are written (release), loaded before views are made (acquire).
    verified: AtomicU64,
    /// The size and CRC32C the manifest announced.
    expect: (u64, u32),
    /// Where the buffer goes when the body is dropped (none: freed).
    home: Option<Weak<BufferPool>>,
    /// Called after each verified prefix is published (wakes the readers waiting for it).
    on_verified: Box<dyn Fn() + Send + Sync>,
}

// SAFETY: the only shared mutable state is the buffer, whose bytes are written by the one `Filling` and
// read only below `verified` (see `Filling::append` and `Partial::slice`); everything else is an atomic
// or immutable. `on_verified` is `Send + Sync`.
unsafe impl Send for Partial {}
// SAFETY: as above.
unsafe impl Sync for Partial {}

impl Partial {
    /// Made only by [`Filling::new`], with its one writer.
    fn new(
        mut buffer: Vec<u8>,
        expect: (u64, u32),
        home: Option<Weak<BufferPool>>,
        on_verified: impl Fn() + Send + Sync + 'static,
    ) -> Self {
        buffer.clear();
        buffer.reserve_exact(expect.0 as usize);
        let mut buffer = std::mem::ManuallyDrop::new(buffer);
        let (ptr, cap) = (NonNull::new(buffer.as_mut_ptr()).expect("a Vec's pointer"), buffer.capacity());
        Partial { ptr, cap, verified: AtomicU64::new(0), expect, home, on_verified: Box::new(on_verified) }
    }

    /// Bytes verified so far.
    pub fn verified(&self) -> u64 {
        self.verified.load(Ordering::Acquire)
    }

    /// Bytes `range`, without a copy, if all of them are verified.
    pub fn slice(self: &Arc<Self>, range: std::ops::Range<u64>) -> Option<bytes::Bytes> {
        if range.start > range.end || range.end > self.verified() {
            return None;
        }
        let view = View { body: self.clone(), start: range.start as usize, len: (range.end - range.start) as usize };
        Some(bytes::Bytes::from_owner(view))
    }

    fn publish(&self, end: u64) {
        self.verified.store(end, Ordering::Release);
        (self.on_verified)();
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `cap` are those of the `Vec` given to `new`, which was not freed; with length 0
        // no element is read or dropped. No view exists any more (each holds an `Arc` of this).
        let buffer = unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), 0, self.cap) };
        if let Some(pool) = self.home.as_ref().and_then(Weak::upgrade) {
            pool.recycle(buffer);
        }
    }
}

/// A verified range of a [`Partial`], the owner behind a [`bytes::Bytes`].
struct View {
    body: Arc<Partial>,
    start: usize,
    len: usize,
}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `[start, start + len)` lay within the verified prefix when the view was made (checked
        // in `slice` after an acquire load that pairs with the writer's release store), or within what
        // the writer had written when it was consumed (`finish`): those bytes are initialized, within the
        // allocation, and never written again (the writer only writes past what it has written, and
        // publishes only that). `body` keeps the allocation alive.
        unsafe { std::slice::from_raw_parts(self.body.ptr.as_ptr().add(self.start), self.len) }
    }
}

/// The writing side of a [`Partial`], owned by one fetch attempt: the only one to write its buffer (a
/// `Partial` is only made with its `Filling`, which cannot be cloned).
pub struct Filling {
    partial: Arc<Partial>,
    /// Bytes written (and initialized) so far.
    written: u64,
    checkpoints: std::collections::VecDeque<(u64, u32)>,
    /// The end of the last checkpoint that matched (0: none yet).
    matched: u64,
}

/// A checkpoint that did not match: the bytes `[start, end)` of the body (from the last checkpoint that
/// matched) hold the bytes that differ, which a client names when it asks the server to recheck them. The
/// source of the `InvalidData` error [`Filling::append`] and [`Filling::commit`] fail with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the body's first {end} bytes have CRC32C {got:08x}, its checkpoint says {want:08x}")]
pub struct FailedCheckpoint {
    pub start: u64,
    pub end: u64,
    pub got: u32,
    pub want: u32,
}

impl FailedCheckpoint {
    /// The failed checkpoint `e` says, if it says one (an `InvalidData` error of a [`Filling`]).
    pub fn of(e: &std::io::Error) -> Option<FailedCheckpoint> {
        e.get_ref()?.downcast_ref::<FailedCheckpoint>().copied()
    }
}

impl Filling {
    /// An empty body of `expect.0` bytes with CRC32C `expect.1`, to be written into `buffer` (emptied, its
    /// capacity reserved), which returns to `home` once the body and every view of it are dropped;
    /// `on_verified` runs whenever more of it is verified.
    pub fn new(
        buffer: Vec<u8>,
        expect: (u64, u32),
        home: Option<Weak<BufferPool>>,
        on_verified: impl Fn() + Send + Sync + 'static,
    ) -> Self {
        let partial = Arc::new(Partial::new(buffer, expect, home, on_verified));
        Filling { partial, written: 0, checkpoints: Default::default(), matched: 0 }
    }

    /// The body readers share.
    pub fn partial(&self) -> &Arc<Partial> {
        &self.partial
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
    /// and CRC32C; otherwise the body is released only whole. Returns whether they are used.
    pub fn expect_checkpoints(&mut self, checkpoints: Vec<(u64, u32)>) -> bool {
        let fits = self.written == 0 && checkpoints.last() == Some(&self.partial.expect);
        if fits {
            self.checkpoints = checkpoints.into();
        }
        fits
    }

    /// Appends `data`, extending `crc` (the CRC32C of everything written before) over it; at each
    /// checkpoint reached, publishes the prefix if `crc` matches it, and fails with `InvalidData` if not.
    /// Bytes past the manifest's size fail with `InvalidData` too (the client stops before).
    pub fn append(&mut self, data: &[u8], crc: &mut u32) -> std::io::Result<()> {
        let room = self.spare(data.len());
        if room.len() < data.len() {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "the body runs past the manifest's size"));
        }
        // SAFETY: `MaybeUninit<u8>` has `u8`'s layout; `room` and `data` (the response's) do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), room.as_mut_ptr().cast::<u8>(), data.len()) };
        // SAFETY: the first `data.len()` bytes of the room were just written.
        unsafe { self.commit(data.len(), crc) }
    }

    /// Room for up to `want` bytes past what is written, within the manifest's size: the receiver reads
    /// into it, then [`Filling::commit`]s what it read.
    pub fn spare(&mut self, want: usize) -> &mut [std::mem::MaybeUninit<u8>] {
        let at = self.written as usize;
        let end = (self.partial.expect.0 as usize).min(at.saturating_add(want));
        // The reservation in `Partial::new` made room for the manifest's size.
        assert!(end <= self.partial.cap, "a body within its size fits its buffer");
        // SAFETY: `[at, end)` is within the allocation (asserted) and past everything published
        // (`verified <= written == at`), so no view covers it; this `Filling` is the only writer (it is
        // created once per `Partial` and not cloned), and `&mut self` lends the room to one caller at a time.
        unsafe { std::slice::from_raw_parts_mut(self.partial.ptr.as_ptr().add(at).cast(), end - at) }
    }

    /// The first `n` bytes of the last [`Filling::spare`] were written: extends `crc` over them and, at
    /// each checkpoint reached, publishes the prefix if `crc` matches it, or fails with `InvalidData`.
    ///
    /// # Safety
    ///
    /// The caller has written (initialized) the first `n` bytes of the room the last `spare` gave.
    pub unsafe fn commit(&mut self, n: usize, crc: &mut u32) -> std::io::Result<()> {
        let mut left = n;
        assert!(self.written + n as u64 <= self.partial.expect.0, "commits only what was given room");
        while left > 0 {
            let next = self.checkpoints.front().copied();
            let take = next.map_or(left, |(end, _)| ((end - self.written) as usize).min(left));
            // SAFETY: `[written, written + take)` was given as room by `spare` and initialized by the
            // caller (this function's contract), within the allocation, and no view covers it yet.
            let now = unsafe { std::slice::from_raw_parts(self.partial.ptr.as_ptr().add(self.written as usize), take) };
            *crc = batchfs::crc::crc32c_append(*crc, now);
            self.written += take as u64;
            left -= take;
            if let Some((end, want)) = next.filter(|&(end, _)| end == self.written) {
                if *crc != want {
                    let failed = FailedCheckpoint { start: self.matched, end, got: *crc, want };
                    return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, failed));
                }
                self.matched = end;
                self.checkpoints.pop_front();
                self.partial.publish(end);
            }
        }
        Ok(())
    }

    /// The whole body as written, for the caller to keep once it has verified it against the manifest
    /// (readers of [`Partial::slice`] still see only what a checkpoint verified).
    pub fn finish(self) -> bytes::Bytes {
        let view = View { body: self.partial.clone(), start: 0, len: self.written as usize };
        bytes::Bytes::from_owner(view)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn filling_of(body: &[u8]) -> Filling {
        Filling::new(Vec::new(), (body.len() as u64, crc32c::crc32c(body)), None, || {})
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
            let mut f = filling_of(&body);
            let p = f.partial().clone();
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
                if let Err(e) = f.append(piece, &mut crc) {
                    // The span it names (what a recheck asks for) holds the flipped byte, from the last
                    // verified prefix on.
                    let span = FailedCheckpoint::of(&e).expect("a failed checkpoint");
                    let i = flipped.expect("only a flipped byte fails") as u64;
                    prop_assert!(span.start == p.verified() && span.start <= i && i < span.end, "{span:?} {i}");
                    failed = true;
                    break;
                }
                let now = p.verified();
                prop_assert!(now >= before);
                prop_assert_eq!(p.slice(0..now).unwrap(), &body[..now as usize]);
                prop_assert!(p.slice(0..now + 1).is_none());
                if let Some(i) = flipped {
                    prop_assert!(now <= i as u64);
                }
            }
            prop_assert_eq!(failed, flipped.is_some());
            if !failed {
                prop_assert_eq!(p.verified(), body.len() as u64);
                prop_assert_eq!(crc, crc32c::crc32c(&body));
                let early = p.slice(0..p.verified()).unwrap();
                prop_assert_eq!(f.finish(), &body[..]);
                prop_assert!(p.slice(0..p.verified()).is_some());
                prop_assert_eq!(early, &body[..], "views made before the end stay valid");
            }
        }
    }

    #[test]
    fn checkpoints_that_do_not_end_at_the_manifests_body_are_not_used() {
        let body = vec![7u8; 100];
        let mut f = filling_of(&body);
        assert!(!f.expect_checkpoints(vec![(50, crc32c::crc32c(&body[..50])), (100, 0)]));
        assert!(!f.expect_checkpoints(vec![(50, crc32c::crc32c(&body[..50]))]));
        let mut crc = 0;
        f.append(&body, &mut crc).unwrap();
        assert_eq!(f.partial.verified(), 0, "without checkpoints nothing is released before the end");
        let mut late = filling_of(&body);
        late.append(&body[..10], &mut 0).unwrap();
        assert!(!late.expect_checkpoints(checkpoints(&body, 50)), "checkpoints come before the first byte");
    }
}
