//! Rechecks of the disk tier's copies that clients ask for: a copy written over in place under the running
//! server (bit rot, a stray write) was served, the client refused the bytes by their checksum, asked again,
//! got the same bytes until `timeout`, and every later epoch the same. A client whose body failed its
//! checksum names the failing byte ranges of the body on its retry to the server that sent it
//! (`x-batchfs-recheck`, `batchfs::api::parse_recheck`); the server reads again, before it answers, only the
//! units of its copies that hold those bytes (each a part, a TFRecord frame or a 4 MiB chunk of the object:
//! the index's CRC32Cs, [`super::Unit::holds`]), never a whole object. A unit that differs drops the copy
//! (never served again; the body, and the ones after, read the store, and the stager copies it again); one
//! that matches keeps it (the fault was the link's). A copy that cannot be opened or read is kept: only bytes
//! that fail their CRC drop a copy.
//!
//! **Bounds.** A request names at most 16 ranges, all within its body, merged where they overlap and mapped
//! in one walk of the body's layout, once a permit is held. At most `recheck_concurrency`
//! rechecks run at once on a server ([`Rechecks::try_begin`]); one more is refused at once (counted; its
//! body is served as it would be, and its client names the ranges again on its next retry), so no client
//! queues reads on the server. One recheck of a copy runs at a time: another of the same copy waits for it
//! ([`Rechecks::copy`]) and then finds the copy dropped, or checks its own ranges.

use super::tier::Tier;
use super::{ObjectSource, Unit};
use batchfs::encode::Segment;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

/// The rechecks running on a server: at most `max` at once, one per copy.
pub struct Rechecks {
    max: usize,
    running: AtomicUsize,
    /// The copies being rechecked now (by name).
    copies: Mutex<HashSet<String>>,
    done: Condvar,
}

/// One of the rechecks a server runs at once: given back when dropped.
pub struct Permit<'a>(&'a Rechecks);

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A copy this recheck alone reads now: the next one of it may begin when dropped.
pub struct Owned<'a>(&'a Rechecks, String);

impl Drop for Owned<'_> {
    fn drop(&mut self) {
        self.0.copies.lock().expect("rechecks").remove(&self.1);
        self.0.done.notify_all();
    }
}

impl Rechecks {
    /// At most `max` rechecks at once (at least one).
    pub fn new(max: usize) -> Self {
        Rechecks { max: max.max(1), running: AtomicUsize::new(0), copies: Mutex::default(), done: Condvar::new() }
    }

    /// A recheck's permit, where fewer than `max` run now; `None`: refused (never waited for).
    pub fn try_begin(&self) -> Option<Permit<'_>> {
        let max = self.max;
        self.running.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1)).ok()?;
        Some(Permit(self))
    }

    /// Copy `name` for this recheck alone: waits while another recheck of it runs (at most `max` wait, as
    /// each holds a permit). Blocks: call on the blocking pool.
    pub fn copy(&self, name: &str) -> Owned<'_> {
        let mut copies = self.copies.lock().expect("rechecks");
        while copies.contains(name) {
            copies = self.done.wait(copies).expect("rechecks");
        }
        copies.insert(name.to_owned());
        Owned(self, name.to_owned())
    }
}

/// What a recheck did, copy by copy.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Rechecked {
    /// Copies whose named units matched the index, or could not be read: kept.
    pub kept: usize,
    /// Copies whose named units differed from the index: dropped.
    pub dropped: usize,
    /// Refused: as many rechecks running as the server allows; nothing read.
    pub refused: bool,
}

/// The ranges of objects (storage number, offset, length) that the bytes `spans` (`[start, end)`) of a body
/// laid out as `segments` are read from; the body's own bytes (framing made by the server) are none.
pub fn ranges_of(segments: &[Segment], spans: &[(u64, u64)]) -> Vec<(u32, u64, u64)> {
    // Sorted and merged (a client may name one range many times over): each byte of the body mapped once,
    // in one walk of the segments, nothing of them copied.
    let mut sorted = spans.to_vec();
    sorted.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
    for (start, end) in sorted {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    let (mut out, mut pos, mut first) = (Vec::new(), 0u64, 0usize);
    for segment in segments {
        let (start, end) = (pos, pos + segment.len());
        pos = end;
        while first < merged.len() && merged[first].1 <= start {
            first += 1;
        }
        let Segment::Data { shard, offset, .. } = *segment else { continue };
        for &(a, b) in merged[first..].iter().take_while(|span| span.0 < end) {
            let (from, to) = (a.max(start), b.min(end));
            if from < to {
                out.push((shard, offset + (from - start), to - from));
            }
        }
    }
    out
}

/// The first of `units` whose bytes in copy `path` differ from the index, or `None`: each unit read alone
/// (one buffer of the largest). An error where the copy cannot be opened or read (nothing said of its bytes).
fn differing_unit<'u>(path: &Path, units: impl IntoIterator<Item = &'u Unit>) -> io::Result<Option<Unit>> {
    let copy = std::fs::File::open(path)?;
    let mut buffer = Vec::new();
    for unit in units {
        buffer.resize(unit.len as usize, 0);
        // The disk's bytes, not the page cache's: copies read directly (`O_DIRECT`) by bodies keep the pages
        // of their check at start, which a recheck through the cache would find right however the disk
        // rotted since. (Pages mapped by the server stay: bodies read those too.)
        let _ = batchfs::fd::advise(&copy, unit.offset, unit.len, libc::POSIX_FADV_DONTNEED);
        copy.read_exact_at(&mut buffer, unit.offset)?;
        if !unit.holds(&buffer) {
            return Ok(Some(*unit));
        }
    }
    Ok(None)
}

impl ObjectSource {
    /// Rechecks the tier's copies under the bytes `spans` (`[start, end)`) of a body laid out as `segments`
    /// of dataset `dataset`: the units holding them are read from the copies against the index, and a copy
    /// whose bytes differ is dropped (see the module's note). Copies not held, or not checked yet (found at
    /// start: each is read whole before it is first served), are left alone. The permit comes first: a
    /// refused recheck maps nothing. Blocks: call on the blocking pool.
    pub fn recheck(&self, dataset: &str, segments: &[Segment], spans: &[(u64, u64)]) -> Rechecked {
        let mut done = Rechecked::default();
        let Some(tier) = self.tier() else { return done };
        let Some(_permit) = self.context.rechecks.try_begin() else {
            tier.counters.recheck_refused.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%dataset, "disk tier: a recheck refused, as many running as recheck_concurrency");
            done.refused = true;
            return done;
        };
        let mut objects: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
        for (n, offset, len) in ranges_of(segments, spans) {
            objects.entry(n).or_default().push((offset, len));
        }
        for (n, spans) in objects {
            let Some(file) = self.file(n) else { continue };
            let name = self.tier_name(file);
            if !tier.contains(&name) || tier.is_unchecked(&name) {
                continue;
            }
            let _owned = self.context.rechecks.copy(&name);
            // Dropped by the recheck this one waited for: its verdict is this one's too.
            let Some((path, true)) = tier.get(&name) else { continue };
            let units: BTreeSet<Unit> = spans.iter().flat_map(|&(offset, len)| self.units(n, offset, len)).collect();
            tier.counters.rechecked.fetch_add(1, Ordering::Relaxed);
            match differing_unit(&path, &units) {
                Ok(None) => done.kept += 1,
                Ok(Some(unit)) => {
                    done.dropped += 1;
                    self.drop_copy(tier, dataset, n, &name, &unit);
                }
                Err(e) => {
                    done.kept += 1;
                    let key = self.path_of(n);
                    tracing::warn!(
                        %dataset, key = %key.display(), copy = %path.display(), error = %e,
                        "disk tier: cannot read a copy to recheck it: kept"
                    );
                }
            }
        }
        done
    }

    /// Drops copy `name` of object `n`, whose `unit` differs from the index: counted and said once.
    fn drop_copy(&self, tier: &Tier, dataset: &str, n: u32, name: &str, unit: &Unit) {
        if tier.take_out(name) {
            tier.counters.recheck_dropped.fetch_add(1, Ordering::Relaxed);
            let key = self.path_of(n);
            let range = format!("{}-{}", unit.offset, unit.offset + unit.len - 1);
            tracing::warn!(
                %dataset, key = %key.display(), %range, copy = %name,
                "disk tier: a copy's bytes differ from the index (a client's recheck): dropped, read from the store"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{context, open, read_all_and_compare, upload};
    use super::*;
    use batchfs::index::Part;
    use object_store::memory::InMemory;
    use std::sync::Arc;

    /// A dataset of three objects copied into a tier: the local files, the tier's and the index's
    /// directories (to outlive the dataset), the dataset, its source and the tier.
    struct Copied {
        local: tempfile::TempDir,
        _dirs: [tempfile::TempDir; 2],
        ds: crate::catalog::Dataset,
        source: Arc<ObjectSource>,
        tier: Arc<Tier>,
        context: Arc<super::super::ObjectContext>,
    }

    fn copied() -> Copied {
        let (local, _) = crate::storage::fixtures::dataset(120, 40_000, 3);
        let store = Arc::new(InMemory::new());
        upload(&store, local.path(), "ds");
        let (tier_dir, index_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let context = context(Some(tier_dir.path()), 1 << 30);
        let ds = open(&store, &context, index_dir.path());
        let (source, tier) = (ds.storage.objects().unwrap().clone(), context.tier.clone().unwrap());
        assert_eq!(tier.copies(), 3, "indexing copied every object");
        Copied { local, _dirs: [tier_dir, index_dir], ds, source, tier, context }
    }

    impl Copied {
        /// The first and the last part of object 0, the name of its copy and the copy's path.
        fn object_0(&self) -> (Part, Part, String, std::path::PathBuf) {
            let parts: Vec<&Part> =
                self.ds.index.samples.iter().flat_map(|s| s.parts.iter()).filter(|p| p.shard == 0).collect();
            assert!(parts.len() > 2);
            let name = self.source.tier_name(&self.ds.index.shards[0]);
            let path = self.tier.get(&name).unwrap().0;
            (parts[0].clone(), parts[parts.len() - 1].clone(), name, path)
        }

        fn counted(&self) -> [u64; 4] {
            let c = &self.tier.counters;
            [&c.rechecked, &c.recheck_dropped, &c.recheck_refused, &c.failures].map(|n| n.load(Ordering::Relaxed))
        }
    }

    /// A recheck of the objects' `ranges`, as a body made of them (one after another) names all its bytes.
    fn recheck_of(source: &ObjectSource, ranges: &[(u32, u64, u64)]) -> Rechecked {
        let segments: Vec<Segment> =
            ranges.iter().map(|&(shard, offset, len)| Segment::Data { shard, offset, len }).collect();
        let len = segments.iter().map(Segment::len).sum();
        source.recheck("ds", &segments, &[(0, len)])
    }

    /// A body's ranges map to the objects' bytes they were read from, framing to none, in one walk: a
    /// range named many times over (16 times the whole body mapped it 16 times, copying the layout each
    /// time) maps once, and the walk agrees with slicing the layout range by range.
    #[test]
    fn a_body_s_ranges_map_once_to_the_objects_bytes() {
        let segments = vec![
            Segment::Inline(vec![0; 12]),
            Segment::Data { shard: 3, offset: 100, len: 50 },
            Segment::Inline(vec![0; 4]),
            Segment::Data { shard: 1, offset: 0, len: 30 },
        ];
        let whole = ranges_of(&segments, &[(0, 96)]);
        assert_eq!(whole, [(3, 100, 50), (1, 0, 30)]);
        assert_eq!(ranges_of(&segments, &[(0, 96); 16]), whole);
        let spans = [(70, 80), (5, 20), (15, 30), (62, 70)];
        let mut sliced = Vec::new();
        for (start, end) in [(5, 30), (62, 80)] {
            for s in batchfs::encode::slice_segments(&segments, start, end) {
                if let Segment::Data { shard, offset, len } = s {
                    sliced.push((shard, offset, len));
                }
            }
        }
        assert_eq!(ranges_of(&segments, &spans), sliced);
        assert_eq!(sliced, [(3, 100, 18), (1, 0, 14)]);
    }

    /// One byte of a copy written over in place under the server: a recheck of a range elsewhere in it reads
    /// only that range and keeps the copy; a recheck of the range holding the byte drops it, and the bytes
    /// come from the store again, right.
    #[test]
    fn a_range_that_differs_drops_its_copy_and_one_that_matches_keeps_it() {
        let c = copied();
        let (first, last, name, path) = c.object_0();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let byte = std::fs::read(&path).unwrap()[(last.offset + 5) as usize];
        file.write_all_at(&[byte ^ 0x10], last.offset + 5).unwrap();
        let kept = recheck_of(&c.source, &[(0, first.offset, first.len)]);
        assert_eq!(kept, Rechecked { kept: 1, ..Default::default() });
        assert!(c.tier.contains(&name) && path.exists(), "a range that matches keeps its copy");
        assert_eq!(c.counted(), [1, 0, 0, 0]);
        let dropped = recheck_of(&c.source, &[(0, last.offset + 3, 4), (1, 0, 10)]);
        assert_eq!(dropped, Rechecked { kept: 1, dropped: 1, refused: false }, "object 1's copy matches");
        assert!(!c.tier.contains(&name) && !path.exists(), "the copy dropped");
        assert_eq!(c.counted(), [3, 1, 0, 1]);
        assert_eq!(recheck_of(&c.source, &[(0, 0, 10)]), Rechecked::default(), "no copy left to recheck");
        read_all_and_compare(&c.ds, c.local.path());
    }

    /// A copy that cannot be opened (gone from under the tier) is kept: only bytes that fail their CRC drop a
    /// copy (the reverted attempt dropped good copies on any open error).
    #[test]
    fn a_copy_that_cannot_be_opened_is_kept() {
        let c = copied();
        let (first, _, name, path) = c.object_0();
        let aside = path.with_extension("aside");
        std::fs::rename(&path, &aside).unwrap();
        let kept = recheck_of(&c.source, &[(0, first.offset, first.len)]);
        assert_eq!(kept, Rechecked { kept: 1, ..Default::default() });
        assert!(c.tier.contains(&name));
        assert_eq!(c.counted(), [1, 0, 0, 0]);
        std::fs::rename(&aside, &path).unwrap();
    }

    /// At most `recheck_concurrency` rechecks run at once, one more refused at once (reading nothing, the
    /// copy kept, counted); a second recheck of one copy waits for the first, one of another copy does not.
    #[test]
    fn rechecks_are_bounded_per_server_and_run_one_at_a_time_per_copy() {
        let rechecks = Rechecks::new(2);
        let (a, _b) = (rechecks.try_begin().unwrap(), rechecks.try_begin().unwrap());
        assert!(rechecks.try_begin().is_none(), "a third refused");
        drop(a);
        assert!(rechecks.try_begin().is_some(), "one given back, one more begins");
        let owned = rechecks.copy("x");
        std::thread::scope(|s| {
            let second = s.spawn(|| drop(rechecks.copy("x")));
            drop(rechecks.copy("y"));
            std::thread::sleep(std::time::Duration::from_millis(200));
            assert!(!second.is_finished(), "a second recheck of a copy waits for the first");
            drop(owned);
            second.join().unwrap();
        });

        let c = copied();
        let (_, last, name, path) = c.object_0();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[0xff; 8], last.offset).unwrap();
        let held: Vec<Permit<'_>> = std::iter::from_fn(|| c.context.rechecks.try_begin()).collect();
        assert_eq!(held.len(), 2, "recheck_concurrency's default");
        let refused = recheck_of(&c.source, &[(0, last.offset, last.len)]);
        assert_eq!(refused, Rechecked { refused: true, ..Default::default() });
        assert!(c.tier.contains(&name));
        assert_eq!(c.counted(), [0, 0, 1, 0]);
        drop(held);
        assert_eq!(recheck_of(&c.source, &[(0, last.offset, last.len)]).dropped, 1);
    }
}
