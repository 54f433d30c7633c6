//! Units: the ranges of an object whose bytes the index can check, and how a body's ranges become them
//! ([`units_of`]), end a body chunk ([`take_of`]) and merge into GETs ([`coalesce`]). Pure functions of
//! the index: no store, no I/O.

use batchfs::index::{chunk_count, ShardInfo, CHUNK_BYTES};

/// A range of one object whose bytes the index can check: a part (its CRC32C), a TFRecord part's whole
/// frame (its header and footer are functions of the part's length and CRC32C), or a [`CHUNK_BYTES`]
/// chunk of the object (its CRC32C).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Unit {
    pub object: u32,
    pub offset: u64,
    pub len: u64,
    pub crc32c: u32,
    /// A TFRecord frame: `crc32c` is its data's.
    pub frame: bool,
}

impl Unit {
    /// Whether `bytes` (this unit's) are what the index says.
    pub fn holds(&self, bytes: &[u8]) -> bool {
        use batchfs::tfrecord::{frame_footer, frame_header, FOOTER_LEN, HEADER_LEN};
        if !self.frame {
            return batchfs::crc::crc32c(bytes) == self.crc32c;
        }
        let data_len = self.len - HEADER_LEN - FOOTER_LEN;
        let (header, rest) = bytes.split_at(HEADER_LEN as usize);
        let (data, footer) = rest.split_at(data_len as usize);
        header == frame_header(data_len)
            && footer == frame_footer(self.crc32c)
            && batchfs::crc::crc32c(data) == self.crc32c
    }
}

/// [`super::ObjectSource::take`] over `units`, the units of `len` bytes at `offset`.
pub fn take_of(units: &[Unit], offset: u64, len: u64, room: u64, empty: bool) -> u64 {
    let end = offset + len;
    let mut fits = 0;
    for unit in units {
        let unit_end = (unit.offset + unit.len).min(end);
        if unit_end - offset > room {
            return if fits == 0 && empty { unit_end - offset } else { fits };
        }
        fits = unit_end - offset;
    }
    fits.max(len.min(room))
}

/// The units whose bytes hold `len` bytes at `offset` of object `n` (`file`, whose parts, or frames, are
/// `parts`, sorted): the parts it overlaps where they cover it without a gap, else the [`CHUNK_BYTES`]
/// chunks it spans.
pub fn units_of(parts: &[Unit], file: &ShardInfo, n: u32, offset: u64, len: u64) -> Vec<Unit> {
    let end = offset + len;
    let first = parts.partition_point(|u| u.offset + u.len <= offset);
    let mut covered = offset;
    let mut out = Vec::new();
    for u in &parts[first..] {
        if u.offset >= end || u.offset > covered {
            break;
        }
        covered = covered.max(u.offset + u.len);
        out.push(*u);
    }
    if covered >= end && !out.is_empty() {
        return out;
    }
    let last = chunk_count(file.size) - 1;
    let (from, past) = (offset / CHUNK_BYTES, end.div_ceil(CHUNK_BYTES).max(offset / CHUNK_BYTES + 1));
    (from..past.min(last + 1))
        .map(|k| Unit {
            object: n,
            offset: k * CHUNK_BYTES,
            len: (file.size - k * CHUNK_BYTES).min(CHUNK_BYTES),
            crc32c: file.chunk_crc(k).unwrap_or(0),
            frame: false,
        })
        .collect()
}

/// Units read with one GET: `units[first..past]`, all of `object`, `offset..offset + len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub object: u32,
    pub offset: u64,
    pub len: u64,
    pub first: usize,
    pub past: usize,
}

/// Merges `units` (sorted, without overlaps) into reads: consecutive units of one object at most `gap`
/// bytes apart share a read while it stays within `max` bytes (a unit longer than `max` is a read of
/// its own).
pub fn coalesce(units: &[Unit], gap: u64, max: u64) -> Vec<Read> {
    let mut reads: Vec<Read> = Vec::new();
    for (i, u) in units.iter().enumerate() {
        if let Some(r) = reads.last_mut() {
            let end = r.offset + r.len;
            if r.object == u.object && u.offset >= end && u.offset - end <= gap && u.offset + u.len - r.offset <= max {
                r.len = u.offset + u.len - r.offset;
                r.past = i + 1;
                continue;
            }
        }
        reads.push(Read { object: u.object, offset: u.offset, len: u.len, first: i, past: i + 1 });
    }
    reads
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn plain(spec: &[(u32, u64, u64)]) -> Vec<Unit> {
        spec.iter().map(|&(object, offset, len)| Unit { object, offset, len, crc32c: 0, frame: false }).collect()
    }

    #[test]
    fn neighbours_merge_far_ones_and_other_objects_do_not() {
        let units = plain(&[(0, 0, 10), (0, 15, 5), (0, 100, 10), (1, 110, 10), (1, 120, 10)]);
        let reads = coalesce(&units, 8, 1 << 20);
        let got: Vec<(u32, u64, u64, usize, usize)> =
            reads.iter().map(|r| (r.object, r.offset, r.len, r.first, r.past)).collect();
        assert_eq!(got, vec![(0, 0, 20, 0, 2), (0, 100, 10, 2, 3), (1, 110, 20, 3, 5)]);
        // A read never grows past `max`.
        let reads = coalesce(&units, 8, 15);
        assert_eq!(reads.len(), 5, "{reads:?}");
    }

    #[test]
    fn a_range_is_read_as_the_parts_that_cover_it_else_as_chunks() {
        let unit = |offset, len| Unit { object: 0, offset, len, crc32c: 7, frame: true };
        // Frames back to back from 0, then a gap (a skipped region), then one more frame.
        let parts = [unit(0, 100), unit(100, 50), unit(150, 200), unit(400, 10)];
        let file = ShardInfo { size: 3 * CHUNK_BYTES + 5, ..Default::default() };
        let at = |o, l| units_of(&parts, &file, 0, o, l);
        assert_eq!(at(10, 20), vec![parts[0]], "inside one frame");
        assert_eq!(at(0, 150), parts[..2].to_vec(), "two frames exactly");
        assert_eq!(at(90, 100), parts[..3].to_vec(), "across frames");
        assert_eq!(at(402, 3), vec![parts[3]]);
        // Across the gap, or past the frames: the chunks, each with its own CRC and the last one short.
        let chunks = at(300, 200);
        assert_eq!(chunks.len(), 1);
        assert_eq!((chunks[0].offset, chunks[0].len, chunks[0].frame), (0, CHUNK_BYTES, false));
        let tail = at(CHUNK_BYTES - 1, 2 * CHUNK_BYTES + 6);
        let spans: Vec<(u64, u64)> = tail.iter().map(|u| (u.offset, u.len)).collect();
        assert_eq!(
            spans,
            vec![(0, CHUNK_BYTES), (CHUNK_BYTES, CHUNK_BYTES), (2 * CHUNK_BYTES, CHUNK_BYTES), (3 * CHUNK_BYTES, 5)]
        );
    }

    #[test]
    fn a_body_chunk_ends_where_a_unit_does() {
        let unit = |offset, len| Unit { object: 0, offset, len, crc32c: 0, frame: true };
        let units = [unit(0, 100), unit(100, 300), unit(400, 50)];
        // Room for the first unit only: the chunk takes it, and the next chunk starts at a unit.
        assert_eq!(take_of(&units, 0, 450, 150, true), 100);
        assert_eq!(take_of(&units, 0, 450, 400, false), 400);
        assert_eq!(take_of(&units, 0, 450, 1000, false), 450);
        // A unit larger than a whole chunk: taken whole by an empty chunk, left by one that is not.
        assert_eq!(take_of(&units[1..], 100, 350, 50, true), 300);
        assert_eq!(take_of(&units[1..], 100, 350, 50, false), 0);
        // A segment ending inside its last unit (a range request): up to the segment's end.
        assert_eq!(take_of(&units, 0, 120, 1000, false), 120);
    }

    #[test]
    fn a_frame_holds_only_its_own_header_data_and_footer() {
        use batchfs::tfrecord::{frame_footer, frame_header};
        let data = b"an example's bytes".to_vec();
        let crc32c = batchfs::crc::crc32c(&data);
        let mut frame = frame_header(data.len() as u64).to_vec();
        frame.extend_from_slice(&data);
        frame.extend_from_slice(&frame_footer(crc32c));
        let unit = Unit { object: 0, offset: 0, len: frame.len() as u64, crc32c, frame: true };
        assert!(unit.holds(&frame));
        for i in 0..frame.len() {
            let mut flipped = frame.clone();
            flipped[i] ^= 0x10;
            assert!(!unit.holds(&flipped), "a flip at byte {i} was not caught");
        }
        let part = Unit { offset: 12, len: data.len() as u64, frame: false, ..unit };
        assert!(part.holds(&data) && !part.holds(b"other bytes of the same len"));
    }

    proptest! {
        /// The merged reads cover exactly the wanted units: each unit lies in the one read that lists it,
        /// reads start and end at units, stay within `max` (unless one unit is longer) and join only
        /// units of one object at most `gap` apart.
        #[test]
        fn merged_reads_cover_exactly_the_wanted_ranges(
            raw in proptest::collection::vec((0u32..3, 0u64..5000, 1u64..300), 0..60),
            gap in 0u64..400,
            max in 1u64..3000,
        ) {
            // Sorted, without overlaps, as units are.
            let mut raw = raw;
            raw.sort_unstable();
            let mut units: Vec<Unit> = Vec::new();
            for (object, offset, len) in raw {
                if units.last().is_some_and(|u| u.object == object && u.offset + u.len > offset) {
                    continue;
                }
                units.push(Unit { object, offset, len, crc32c: 0, frame: false });
            }
            let reads = coalesce(&units, gap, max);
            let mut next = 0;
            for r in &reads {
                prop_assert_eq!(r.first, next);
                prop_assert!(r.past > r.first);
                next = r.past;
                let mine = &units[r.first..r.past];
                prop_assert_eq!(r.offset, mine[0].offset);
                prop_assert_eq!(r.offset + r.len, mine[mine.len() - 1].offset + mine[mine.len() - 1].len);
                prop_assert!(r.len <= max || mine.len() == 1);
                for pair in mine.windows(2) {
                    prop_assert_eq!(pair[0].object, pair[1].object);
                    prop_assert!(pair[1].offset - (pair[0].offset + pair[0].len) <= gap);
                }
                prop_assert!(mine.iter().all(|u| u.object == r.object));
            }
            prop_assert_eq!(next, units.len());
        }
    }
}
