//! The fixed-offset layout of `rolling/` for index-driven readers (DALI's TFRecord reader built once).
//!
//! Such a reader reads each batch file's `.idx` twin once, when its pipeline is built, and reads every
//! later pass at those offsets. So each name of `rolling/` keeps one layout for every epoch it serves:
//! record position *p* of `batch-B` starts at the same offset, with the same room, in every epoch. The
//! room is a property of the view, not of the data: the server sends the packed batch (the epoch
//! directories' bytes and checksums), and the mount writes each record at its slot and leaves the rest of
//! the slot a hole, so only the records' bytes cross the network or sit in memory.
//!
//! **Slots by size rank.** For a span of epochs (the epochs a job reads, from `first_epoch`), the slot of
//! rank *r* of batch *B* is the largest *r*-th largest TFRecord frame that batch *B* has in any epoch of
//! the span ([`SlotTable`]): rank 0 the largest record's room, and so on down. Each epoch's batch puts its
//! *r*-th largest record (ties in plan order) in the slot of rank *r*, which therefore always fits, and
//! the rooms stay near the real sizes (one record per slot cannot do better: the *r*-th largest of any
//! epoch needs a slot of at least its size).
//!
//! **Positions.** The slots sit in the file in a fixed pseudo-random order of ranks, so that neighbours are
//! not sorted by size: position *p* of batch *B* holds rank `π_B(p)`, where `π_B` is the Fisher–Yates
//! permutation of `0..n` (`n` records) drawn, as the epoch plans draw theirs, from a SplitMix64 seeded
//! with `(B + 1) * 0x9E3779B97F4A7C15 ^ 0x726F6C6C696E6721` (wrapping): for `i` from `n-1` down to 1, `j`
//! below `i+1`, swap. Position *p* starts at the sum of the slots before it; the file ends with the last
//! slot. A test pins the permutation, as plans are pinned.
//!
//! So a rolling file holds exactly the plan's batch, every record once, in the order of its positions:
//! by size rank through `π_B`, not in plan order. Its `.idx` twin lists `offset slot` per position (the
//! same for every epoch), and a record's frame may be shorter than its slot: DALI reads the frame's own
//! length.

use crate::plan::{EpochPlan, PlanError, PlanOptions, SplitMix64};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The slots of every batch of a span of epochs, by size rank (largest first):
/// `GET /v1/datasets/{name}/rolling`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotTable {
    pub options: PlanOptions,
    /// The first epoch of the span.
    pub first_epoch: u64,
    /// Epochs in the span.
    pub epochs: u64,
    /// Per batch, the room of each rank in bytes, non-increasing.
    pub batches: Vec<Vec<u64>>,
    /// The content id of the index the table was computed from (as `DatasetInfo::index_id`; empty: not
    /// said, as by servers before it said; the server sets it, [`slot_table`] leaves it empty).
    #[serde(default)]
    pub index_id: String,
}

/// Why a slot table cannot be made or used.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RollingError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(
        "a span of {epochs} epochs from epoch {first_epoch} cannot be planned (1 to {MAX_SPAN} epochs, the last \
         at most epoch {max})",
        max = crate::plan::MAX_EPOCH
    )]
    Span { first_epoch: u64, epochs: u64 },
    #[error("record {record} of batch {batch} ({len} bytes) is larger than its slot ({slot} bytes)")]
    DoesNotFit { batch: u64, record: usize, len: u64, slot: u64 },
    #[error("batch {batch} has {records} records; its slots are for {slots}")]
    Records { batch: u64, records: usize, slots: usize },
}

/// The most epochs one slot table spans.
pub const MAX_SPAN: u64 = 10_000;

/// The slot table of `frames` (each sample's TFRecord frame, in bytes) over epochs
/// `first_epoch..first_epoch + epochs` of `options`, computed on up to `threads` threads.
pub fn slot_table(
    frames: &[u64],
    options: PlanOptions,
    first_epoch: u64,
    epochs: u64,
    threads: usize,
) -> Result<SlotTable, RollingError> {
    slot_table_of(frames, None, options, first_epoch, epochs, threads)
}

/// [`slot_table`] of plans that may need the dataset's `objects` (`shuffle=blocks`).
pub fn slot_table_of(
    frames: &[u64],
    objects: Option<&crate::plan::Objects>,
    options: PlanOptions,
    first_epoch: u64,
    epochs: u64,
    threads: usize,
) -> Result<SlotTable, RollingError> {
    options.validate()?;
    let last = first_epoch.checked_add(epochs).and_then(|e| e.checked_sub(1));
    if epochs == 0 || epochs > MAX_SPAN || last.is_none_or(|l| l > crate::plan::MAX_EPOCH) {
        return Err(RollingError::Span { first_epoch, epochs });
    }
    let samples = u32::try_from(frames.len()).map_err(|_| RollingError::Span { first_epoch, epochs })?;
    // Every epoch has the same batches, of the same sizes: the shape comes from any of them.
    let plan_of = |epoch| match objects {
        Some(objects) => EpochPlan::of_objects(objects, epoch, options),
        None => EpochPlan::new(samples, epoch, options),
    };
    let shape = plan_of(first_epoch)?;
    let empty: Vec<Vec<u64>> = (0..shape.batches()).map(|b| vec![0; shape.batch(b).map_or(0, <[u32]>::len)]).collect();
    let threads = threads.clamp(1, epochs as usize);
    let partial = |from: u64| -> Result<Vec<Vec<u64>>, RollingError> {
        let mut table = empty.clone();
        let mut sizes = Vec::new();
        for epoch in (first_epoch + from..first_epoch + epochs).step_by(threads) {
            let plan = plan_of(epoch)?;
            for (b, slots) in table.iter_mut().enumerate() {
                sizes.clear();
                sizes.extend(plan.batch(b as u64)?.iter().map(|&s| frames[s as usize]));
                sizes.sort_unstable_by(|a, b| b.cmp(a));
                for (slot, &size) in slots.iter_mut().zip(&sizes) {
                    *slot = (*slot).max(size);
                }
            }
        }
        Ok(table)
    };
    let parts: Vec<Result<Vec<Vec<u64>>, RollingError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads as u64).map(|t| s.spawn(move || partial(t))).collect();
        handles.into_iter().map(|h| h.join().expect("slot table thread")).collect()
    });
    let mut batches = empty;
    for part in parts {
        for (slots, other) in batches.iter_mut().zip(part?) {
            for (slot, size) in slots.iter_mut().zip(other) {
                *slot = (*slot).max(size);
            }
        }
    }
    Ok(SlotTable { options, first_epoch, epochs, batches, index_id: String::new() })
}

/// `π_B`: the rank at each position of batch `batch`'s file of `n` records (see the module note).
pub fn ranks_by_position(batch: u64, n: usize) -> Vec<usize> {
    let mut ranks: Vec<usize> = (0..n).collect();
    let mut rng = SplitMix64::new((batch + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x726F_6C6C_696E_6721);
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        ranks.swap(i, j);
    }
    ranks
}

/// Where the records of one rolling batch file go, the same for every epoch of its span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileLayout {
    /// Per position, its offset in the file.
    pub offsets: Vec<u64>,
    /// Per position, its room (its rank's slot).
    pub slots: Vec<u64>,
    /// Per rank, its position.
    position_of_rank: Vec<usize>,
    /// The file's size: the end of the last slot.
    pub len: u64,
}

impl FileLayout {
    /// The layout of batch `batch`, whose slots by rank are `by_rank`.
    pub fn new(batch: u64, by_rank: &[u64]) -> Self {
        let ranks = ranks_by_position(batch, by_rank.len());
        let mut position_of_rank = vec![0; ranks.len()];
        let (mut offsets, mut slots) = (Vec::with_capacity(ranks.len()), Vec::with_capacity(ranks.len()));
        let mut at = 0;
        for (position, &rank) in ranks.iter().enumerate() {
            position_of_rank[rank] = position;
            offsets.push(at);
            slots.push(by_rank[rank]);
            at += by_rank[rank];
        }
        FileLayout { offsets, slots, position_of_rank, len: at }
    }

    /// The DALI index of the file: `offset slot` per position, as `tfrecord2idx` writes it.
    pub fn dali_index(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.offsets.len() * 16);
        for (offset, slot) in self.offsets.iter().zip(&self.slots) {
            out.extend_from_slice(format!("{offset} {slot}\n").as_bytes());
        }
        out
    }

    /// The position of each record of an epoch's batch, given the records' frame sizes in plan order
    /// (`batch` names the file in errors): the *r*-th largest (ties in plan order) takes rank *r*'s slot.
    pub fn positions(&self, batch: u64, frames: &[u64]) -> Result<Vec<usize>, RollingError> {
        if frames.len() != self.slots.len() {
            return Err(RollingError::Records { batch, records: frames.len(), slots: self.slots.len() });
        }
        let mut by_size: Vec<usize> = (0..frames.len()).collect();
        by_size.sort_by(|&a, &b| frames[b].cmp(&frames[a]).then(a.cmp(&b)));
        let mut positions = vec![0; frames.len()];
        for (rank, &record) in by_size.iter().enumerate() {
            let position = self.position_of_rank[rank];
            if frames[record] > self.slots[position] {
                let (len, slot) = (frames[record], self.slots[position]);
                return Err(RollingError::DoesNotFit { batch, record, len, slot });
            }
            positions[record] = position;
        }
        Ok(positions)
    }
}

/// The records of a packed TFRecord body: `(offset, frame length)` each, in order; `None` when the body
/// is not a sequence of whole frames (the mount checks bodies before it places them).
pub fn frames_of(body: &[u8]) -> Option<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut at = 0u64;
    while (at as usize) < body.len() {
        let header = body.get(at as usize..at as usize + crate::tfrecord::HEADER_LEN as usize)?;
        let len = u64::from_le_bytes(header[..8].try_into().expect("eight bytes"));
        let frame = crate::tfrecord::frame_len(len.min(crate::tfrecord::MAX_RECORD_LEN));
        if len > crate::tfrecord::MAX_RECORD_LEN || at + frame > body.len() as u64 {
            return None;
        }
        out.push((at, frame));
        at += frame;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_positions() {
        // Pinned: a mount and a DALI index written by another version must agree on where records go.
        assert_eq!(ranks_by_position(0, 8), GOLDEN_BATCH0_N8);
        assert_eq!(ranks_by_position(7, 1), [0]);
        assert!(ranks_by_position(3, 0).is_empty());
    }

    // Computed by an independent Python implementation of the algorithm in the module note.
    const GOLDEN_BATCH0_N8: [usize; 8] = [0, 4, 3, 6, 5, 2, 7, 1];

    #[test]
    fn a_layout_places_records_by_rank_and_lists_its_slots() {
        let layout = FileLayout::new(0, &[900, 500, 400, 300, 200, 150, 120, 100]);
        // Position p holds rank GOLDEN[p].
        assert_eq!(layout.slots, [900, 200, 300, 120, 150, 400, 100, 500]);
        assert_eq!(layout.offsets[..3], [0, 900, 1100]);
        assert_eq!(layout.len, 2670);
        let index = String::from_utf8(layout.dali_index()).unwrap();
        assert_eq!(index.lines().next(), Some("0 900"));
        assert_eq!(index.lines().count(), 8);
        // An epoch's batch: the largest (record 2) goes to rank 0's position, 0; equal sizes in plan order.
        let frames = [100, 100, 850, 480, 20, 300, 110, 399];
        let positions = layout.positions(0, &frames).unwrap();
        assert_eq!(positions[2], 0);
        assert_eq!(positions[3], 7, "rank 1");
        assert_eq!((positions[0], positions[1]), (4, 3), "ranks 5 and 6, in plan order");
        let too_big = [100, 100, 901, 480, 20, 300, 110, 399];
        assert!(matches!(layout.positions(0, &too_big), Err(RollingError::DoesNotFit { record: 2, .. })));
        assert!(matches!(layout.positions(0, &frames[..7]), Err(RollingError::Records { records: 7, .. })));
    }

    #[test]
    fn spans_are_checked() {
        let o = PlanOptions::default();
        assert!(matches!(slot_table(&[10; 5], o, 0, 0, 1), Err(RollingError::Span { .. })));
        assert!(matches!(slot_table(&[10; 5], o, crate::plan::MAX_EPOCH, 2, 1), Err(RollingError::Span { .. })));
        assert!(matches!(slot_table(&[10; 5], o, 0, MAX_SPAN + 1, 1), Err(RollingError::Span { .. })));
        let bad = PlanOptions { batch_size: 0, ..o };
        assert!(matches!(slot_table(&[10; 5], bad, 0, 1, 1), Err(RollingError::Plan(_))));
    }

    #[test]
    fn frames_are_found_in_a_packed_body() {
        let mut body = Vec::new();
        crate::tfrecord::encode_record(b"abc", &mut body);
        crate::tfrecord::encode_record(b"", &mut body);
        assert_eq!(frames_of(&body), Some(vec![(0, 19), (19, 16)]));
        assert_eq!(frames_of(&body[..30]), None, "a cut frame");
        assert_eq!(frames_of(&[]), Some(vec![]));
    }

    /// Heavy-tailed frame sizes: log-normal-ish around 1000 bytes, with an occasional one 10-50 times it.
    fn sizes() -> impl Strategy<Value = Vec<u64>> {
        proptest::collection::vec((50u64..2000, 0u32..100, 10u64..50), 1..400)
            .prop_map(|v| v.into_iter().map(|(s, tail, k)| if tail == 0 { s * k } else { s }).collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
        /// No record of any epoch of the span exceeds its slot, every record gets its own position, and
        /// the slots are as tight as one record per slot allows: each rank's slot is some epoch's record.
        #[test]
        fn every_record_of_the_span_fits_its_own_slot(
            frames in sizes(),
            batch_size in 1u32..64,
            first_epoch in 0u64..1000,
            epochs in 1u64..6,
            seed: u64,
            drop_last: bool,
            threads in 1usize..4,
        ) {
            let options = PlanOptions { batch_size, seed, drop_last, ..PlanOptions::default() };
            let table = slot_table(&frames, options, first_epoch, epochs, threads).unwrap();
            prop_assert_eq!(&table, &slot_table(&frames, options, first_epoch, epochs, 1).unwrap());
            let mut tight = vec![vec![false; batch_size as usize]; table.batches.len()];
            for epoch in first_epoch..first_epoch + epochs {
                let plan = EpochPlan::new(frames.len() as u32, epoch, options).unwrap();
                prop_assert_eq!(plan.batches() as usize, table.batches.len());
                for (b, by_rank) in table.batches.iter().enumerate() {
                    prop_assert!(by_rank.windows(2).all(|w| w[0] >= w[1]));
                    let layout = FileLayout::new(b as u64, by_rank);
                    let record_frames: Vec<u64> =
                        plan.batch(b as u64).unwrap().iter().map(|&s| frames[s as usize]).collect();
                    let positions = layout.positions(b as u64, &record_frames).unwrap();
                    let mut seen = positions.clone();
                    seen.sort_unstable();
                    prop_assert_eq!(seen, (0..record_frames.len()).collect::<Vec<_>>());
                    for (record, &p) in positions.iter().enumerate() {
                        prop_assert!(record_frames[record] <= layout.slots[p]);
                        prop_assert!(layout.offsets[p] + layout.slots[p] <= layout.len);
                        if record_frames[record] == layout.slots[p] {
                            let rank = by_rank.iter().position(|&s| s == layout.slots[p]).unwrap();
                            tight[b][rank] = true;
                        }
                    }
                }
            }
            for (b, by_rank) in table.batches.iter().enumerate() {
                for (rank, &slot) in by_rank.iter().enumerate() {
                    // Equal slots share the first rank's flag.
                    let first = by_rank.iter().position(|&s| s == slot).unwrap();
                    prop_assert!(tight[b][first], "batch {} rank {}: no epoch fills slot {}", b, rank, slot);
                }
            }
        }
    }
}
