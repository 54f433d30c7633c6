//! Epoch plans: which samples form batch `i` of epoch `e`.
//!
//! A plan is a pure function of (number of samples, epoch, [`PlanOptions`]), and with `shuffle = blocks` of
//! the dataset's [`Objects`] too; client and server compute the same one on any machine and version. The
//! algorithm, pinned by golden tests:
//!
//! 1. `order = [0, 1, ..., n-1]`.
//! 2. With `shuffle = global`: seed a SplitMix64 generator with
//!    `seed ^ (epoch + 1) * 0x9E3779B97F4A7C15` (wrapping), then for `i` from `n-1` down to `1` draw
//!    `j` uniformly in `[0, i]` and swap `order[i]`, `order[j]` (Fisher–Yates). `j` is drawn by Lemire's
//!    multiply-shift with rejection: `m = x * (i+1)` as 128 bits; while `(m as u64) < (2^64 - (i+1)) %
//!    (i+1)`, draw again; `j = m >> 64`.
//! 3. With `shuffle = blocks`, over the dataset's objects (sample `s` lives in object `of_sample[s]`, object
//!    `k` has `bytes[k]` bytes; [`EpochPlan::of_objects`]), `order` is rebuilt:
//!    1. Seed a SplitMix64 generator with `seed ^ (epoch + 1) * 0x9E3779B97F4A7C15 ^ 0x626C6F636B732121`
//!       (wrapping; the constant is `blocks!!` in ASCII).
//!    2. `objs` = the objects that hold at least one sample, in increasing id order; shuffle `objs` by
//!       Fisher–Yates as in step 2 (for `i` from `len-1` down to `1`, `j` uniform in `[0, i]`, swap).
//!    3. Cut `objs` into blocks, in its order: start with an empty block; for each object, if the block is
//!       not empty and its bytes plus the object's exceed `block_bytes`, close the block and start a new
//!       one; add the object. So a block holds at most `block_bytes`, or is a single larger object.
//!    4. For each block in turn: list the samples of its objects in increasing sample id, shuffle that
//!       list by Fisher–Yates with the same generator (its draws continue where the previous step's
//!       stopped), and append it to `order`.
//!
//!    So every object is read in one block, whole, and at any point of the epoch the objects begun and
//!    not finished are one block's: at most `block_bytes` of them are in use, while each batch mixes the
//!    samples of a block's many objects. `block_bytes = 0` (not given) cannot be planned: the server puts
//!    its default in first.
//! 4. Batch `b` holds `order[b*batch_size .. min((b+1)*batch_size, n)]`; with `drop_last` an incomplete
//!    last batch is dropped.
//!
//! SplitMix64 (Steele, Lea, Flood 2014): `state += 0x9E3779B97F4A7C15; z = state;
//! z = (z ^ z>>30) * 0xBF58476D1CE4E5B9; z = (z ^ z>>27) * 0x94D049BB133111EB; return z ^ z>>31`.
//!
//! [`randomness`] measures how well a plan mixes a dataset's objects, to compare the modes.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// Largest epoch number accepted.
pub const MAX_EPOCH: u64 = 999_999;
/// Largest batch size accepted.
pub const MAX_BATCH_SIZE: u32 = 1 << 20;
/// Default batch size.
pub const DEFAULT_BATCH_SIZE: u32 = 256;

/// How samples are ordered within an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Shuffle {
    /// A seeded permutation of all samples, different every epoch.
    #[default]
    Global,
    /// Index order, the same every epoch.
    None,
    /// Objects (shards) in a seeded order, cut into blocks of at most `block_bytes`; each block's samples
    /// in a seeded permutation. Each object is read once, whole, with a block of them in use at a time.
    Blocks,
}

impl fmt::Display for Shuffle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Shuffle::Global => "global",
            Shuffle::None => "none",
            Shuffle::Blocks => "blocks",
        })
    }
}

impl FromStr for Shuffle {
    type Err = PlanError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "global" => Ok(Shuffle::Global),
            "none" => Ok(Shuffle::None),
            "blocks" => Ok(Shuffle::Blocks),
            other => Err(PlanError::BadShuffle(other.to_owned())),
        }
    }
}

/// Options that, with the epoch number, determine a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlanOptions {
    pub batch_size: u32,
    pub seed: u64,
    pub shuffle: Shuffle,
    pub drop_last: bool,
    /// With `shuffle = blocks`, the bytes of objects in use at a time; 0 (the default) means not given,
    /// and the server fills in its own before planning. Other modes ignore it. Left out of the JSON when 0,
    /// so documents of the other modes read as they did before it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub block_bytes: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            batch_size: DEFAULT_BATCH_SIZE,
            seed: 0,
            shuffle: Shuffle::Global,
            drop_last: false,
            block_bytes: 0,
        }
    }
}

/// Invalid plan options.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    #[error("batch_size must be between 1 and {MAX_BATCH_SIZE}, got {0}")]
    BadBatchSize(u64),
    #[error("epoch must be between 0 and {MAX_EPOCH}, got {0}")]
    EpochOutOfRange(u64),
    #[error("shuffle must be `global`, `none` or `blocks`, got {0:?}")]
    BadShuffle(String),
    #[error(
        "shuffle=blocks needs the dataset's objects (which shard holds each sample): it is planned by the \
         server; ask it for the epoch's manifest"
    )]
    BlocksNeedObjects,
    #[error("shuffle=blocks needs block_bytes, the bytes of objects in use at a time (e.g. block_bytes=4G)")]
    NoBlockBytes,
    #[error("sample {sample} lives in object {object}, but the dataset has {objects} objects")]
    NoSuchObject { sample: u64, object: u32, objects: u64 },
    #[error("{0} samples: a plan holds at most {max}", max = u32::MAX)]
    TooManySamples(u64),
    #[error("batch {batch} does not exist: epoch {epoch} has {batches} batches")]
    NoSuchBatch { epoch: u64, batch: u64, batches: u64 },
}

impl PlanOptions {
    /// Checks the options.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.batch_size == 0 || self.batch_size > MAX_BATCH_SIZE {
            return Err(PlanError::BadBatchSize(u64::from(self.batch_size)));
        }
        Ok(())
    }

    /// The options of a plan over samples alone, for views that read one sample per open (a mount's
    /// `shuffled/`, `batchfs warm`) and know no objects: `blocks` is planned as `global` there. Each
    /// such read fetches its sample alone whatever the order, so a block order would bound nothing.
    pub fn per_sample(self) -> PlanOptions {
        match self.shuffle {
            Shuffle::Blocks => PlanOptions { shuffle: Shuffle::Global, block_bytes: 0, ..self },
            _ => self,
        }
    }
}

/// SplitMix64, the plan's PRNG.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, bound)` (Lemire's method with rejection); `bound > 0`.
    pub fn below(&mut self, bound: u64) -> u64 {
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(bound);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Where a dataset's samples live: sample `s` in object (shard) `of_sample[s]`, object `k` of `bytes[k]`
/// bytes. What `shuffle = blocks` plans over; objects that hold no sample may be listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Objects<'a> {
    pub of_sample: &'a [u32],
    pub bytes: &'a [u64],
}

impl Objects<'_> {
    /// Number of samples, checked to fit sample ids (u32) and to name only listed objects.
    fn samples(&self) -> Result<u32, PlanError> {
        let n =
            u32::try_from(self.of_sample.len()).map_err(|_| PlanError::TooManySamples(self.of_sample.len() as u64))?;
        if let Some(sample) = self.of_sample.iter().position(|&k| k as usize >= self.bytes.len()) {
            return Err(PlanError::NoSuchObject {
                sample: sample as u64,
                object: self.of_sample[sample],
                objects: self.bytes.len() as u64,
            });
        }
        Ok(n)
    }
}

/// Seed of the `blocks` generator: `blocks!!` in ASCII, so its draws differ from `global`'s.
const BLOCKS_SEED: u64 = 0x626C_6F63_6B73_2121;

/// Fisher–Yates with [`SplitMix64::below`], from the last element down (the module note's step 2).
fn fisher_yates<T>(items: &mut [T], rng: &mut SplitMix64) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

/// The `blocks` order (the module note's step 3), before `drop_last`.
fn blocks_order(objects: &Objects, epoch: u64, options: &PlanOptions) -> Vec<u32> {
    let mut rng = SplitMix64::new(options.seed ^ (epoch + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ BLOCKS_SEED);
    let mut held = vec![false; objects.bytes.len()];
    for &k in objects.of_sample {
        held[k as usize] = true;
    }
    let mut objs: Vec<u32> = (0..objects.bytes.len() as u32).filter(|&k| held[k as usize]).collect();
    fisher_yates(&mut objs, &mut rng);
    // The block of each object; sums in u128, which no u32 count of u64 sizes overflows.
    let mut block_of = vec![0u32; objects.bytes.len()];
    let (mut blocks, mut in_block) = (0u32, 0u128);
    for (i, &k) in objs.iter().enumerate() {
        let bytes = u128::from(objects.bytes[k as usize]);
        if i > 0 && in_block + bytes > u128::from(options.block_bytes) {
            blocks += 1;
            in_block = 0;
        }
        in_block += bytes;
        block_of[k as usize] = blocks;
    }
    // One pass over the samples lists each block's in increasing id.
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); objs.len().min(blocks as usize + 1)];
    for (s, &k) in objects.of_sample.iter().enumerate() {
        members[block_of[k as usize] as usize].push(s as u32);
    }
    let mut order = Vec::with_capacity(objects.of_sample.len());
    for mut block in members {
        fisher_yates(&mut block, &mut rng);
        order.extend_from_slice(&block);
    }
    order
}

/// The plan of one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochPlan {
    pub epoch: u64,
    pub options: PlanOptions,
    /// Sample indices in epoch order (trimmed when `drop_last` drops a partial batch).
    order: Vec<u32>,
}

impl EpochPlan {
    /// Plans epoch `epoch` over `samples` samples with `shuffle` `global` or `none`. `blocks` is an error
    /// ([`PlanError::BlocksNeedObjects`]): it needs the dataset's objects, see [`EpochPlan::of_objects`].
    pub fn new(samples: u32, epoch: u64, options: PlanOptions) -> Result<Self, PlanError> {
        options.validate()?;
        if epoch > MAX_EPOCH {
            return Err(PlanError::EpochOutOfRange(epoch));
        }
        let mut order: Vec<u32> = (0..samples).collect();
        match options.shuffle {
            Shuffle::Global => {
                let mut rng = SplitMix64::new(options.seed ^ (epoch + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                fisher_yates(&mut order, &mut rng);
            }
            Shuffle::None => {}
            Shuffle::Blocks => return Err(PlanError::BlocksNeedObjects),
        }
        Ok(EpochPlan::trimmed(epoch, options, order))
    }

    /// Plans epoch `epoch` over the samples of `objects`, in any mode: `global` and `none` give what
    /// [`EpochPlan::new`] gives for as many samples; `blocks` needs `block_bytes > 0`
    /// ([`PlanError::NoBlockBytes`]). Errors too if `objects` names an object it does not size.
    pub fn of_objects(objects: &Objects, epoch: u64, options: PlanOptions) -> Result<Self, PlanError> {
        let samples = objects.samples()?;
        if options.shuffle != Shuffle::Blocks {
            return EpochPlan::new(samples, epoch, options);
        }
        options.validate()?;
        if epoch > MAX_EPOCH {
            return Err(PlanError::EpochOutOfRange(epoch));
        }
        if options.block_bytes == 0 {
            return Err(PlanError::NoBlockBytes);
        }
        Ok(EpochPlan::trimmed(epoch, options, blocks_order(objects, epoch, &options)))
    }

    /// The plan of `order`, less an incomplete last batch with `drop_last`.
    fn trimmed(epoch: u64, options: PlanOptions, mut order: Vec<u32>) -> Self {
        if options.drop_last {
            let keep = order.len() / options.batch_size as usize * options.batch_size as usize;
            order.truncate(keep);
        }
        EpochPlan { epoch, options, order }
    }

    /// Number of batches.
    pub fn batches(&self) -> u64 {
        (self.order.len() as u64).div_ceil(u64::from(self.options.batch_size))
    }

    /// Samples of batch `batch`, in order.
    pub fn batch(&self, batch: u64) -> Result<&[u32], PlanError> {
        if batch >= self.batches() {
            return Err(PlanError::NoSuchBatch { epoch: self.epoch, batch, batches: self.batches() });
        }
        let size = self.options.batch_size as usize;
        let start = batch as usize * size;
        Ok(&self.order[start..(start + size).min(self.order.len())])
    }

    /// All planned samples in epoch order.
    pub fn order(&self) -> &[u32] {
        &self.order
    }
}

/// How much a plan mixes a dataset's objects ([`randomness`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Randomness {
    /// Mean, over the objects with at least two planned samples, of the distance between the first and
    /// the last position of their samples in the epoch order, as a share of the order's length less one:
    /// 1 when an object's samples span the whole epoch, near 0 when they come together.
    pub spread: f64,
    /// Mean, over the batches of at least two samples, of the share of their pairs of samples that live in
    /// the same object: near the sum of the squared shares of the objects for a uniform shuffle, 1 when
    /// every batch comes from one object.
    pub same_object: f64,
    /// Mean number of distinct objects a batch draws from.
    pub objects_per_batch: f64,
}

/// Figures of how much `plan` mixes the objects of `objects`, to compare the modes (see [`Randomness`]).
/// Every figure is 0 where nothing is there to measure.
///
/// # Panics
///
/// If `plan` names a sample that `objects` does not place, or places it in an object it does not size.
pub fn randomness(plan: &EpochPlan, objects: &Objects) -> Randomness {
    let order = plan.order();
    let objects_len = objects.bytes.len();
    let (mut first, mut last) = (vec![usize::MAX; objects_len], vec![0usize; objects_len]);
    let mut planned = vec![0u64; objects_len];
    for (p, &s) in order.iter().enumerate() {
        let k = objects.of_sample[s as usize] as usize;
        first[k] = first[k].min(p);
        last[k] = p;
        planned[k] += 1;
    }
    let spreads: Vec<f64> = (0..objects_len)
        .filter(|&k| planned[k] >= 2)
        .map(|k| (last[k] - first[k]) as f64 / (order.len() - 1) as f64)
        .collect();
    let (mut same, mut distinct, mut pairs_batches, mut batches) = (0.0, 0u64, 0u64, 0u64);
    let mut count = vec![0u64; objects_len];
    let mut touched = Vec::new();
    for b in 0..plan.batches() {
        let batch = plan.batch(b).expect("b < batches");
        for &s in batch {
            let k = objects.of_sample[s as usize] as usize;
            if count[k] == 0 {
                touched.push(k);
            }
            count[k] += 1;
        }
        let len = batch.len() as u64;
        if len >= 2 {
            let pairs: u64 = touched.iter().map(|&k| count[k] * (count[k] - 1) / 2).sum();
            same += pairs as f64 / (len * (len - 1) / 2) as f64;
            pairs_batches += 1;
        }
        distinct += touched.len() as u64;
        batches += 1;
        for k in touched.drain(..) {
            count[k] = 0;
        }
    }
    let mean = |sum: f64, n: u64| if n == 0 { 0.0 } else { sum / n as f64 };
    Randomness {
        spread: mean(spreads.iter().sum(), spreads.len() as u64),
        same_object: mean(same, pairs_batches),
        objects_per_batch: mean(distinct as f64, batches),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::ops::Range;

    /// `count` objects of heavy-tailed sizes (mostly 1 to 1,000 bytes, one in ten 10 to 50 times that), and
    /// the object of each of `samples` samples, in no particular order.
    fn objects(samples: Range<usize>, count: Range<usize>) -> impl Strategy<Value = (Vec<u32>, Vec<u64>)> {
        let sizes = proptest::collection::vec((1u64..1000, 0u32..10, 10u64..50), count)
            .prop_map(|v| v.into_iter().map(|(s, tail, k)| if tail == 0 { s * k } else { s }).collect::<Vec<_>>());
        (sizes, samples).prop_flat_map(|(bytes, n)| {
            let objects = bytes.len() as u32;
            (proptest::collection::vec(0..objects, n), Just(bytes))
        })
    }

    #[test]
    fn golden_plan() {
        // Pinned: changing these numbers breaks every client/server pair across versions.
        let options =
            PlanOptions { batch_size: 4, seed: 42, shuffle: Shuffle::Global, drop_last: false, block_bytes: 0 };
        let plan = EpochPlan::new(10, 3, options).unwrap();
        assert_eq!(plan.order(), GOLDEN_10_SEED42_EPOCH3);
        assert_eq!(plan.batches(), 3);
        assert_eq!(plan.batch(2).unwrap().len(), 2);
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    // Computed by an independent Python implementation of the algorithm in the module note.
    const GOLDEN_10_SEED42_EPOCH3: &[u32] = &[4, 6, 8, 9, 3, 2, 5, 1, 7, 0];

    /// Seven objects: two that hold no sample (3, and 6 after the others), one above `block_bytes` (4); the
    /// samples of an object are not next to one another.
    const GOLDEN_OF_SAMPLE: &[u32] = &[0, 0, 1, 1, 1, 2, 4, 4, 5, 0, 2, 5, 4, 1];
    const GOLDEN_BYTES: &[u64] = &[30, 50, 20, 999, 120, 40, 7];

    #[test]
    fn golden_blocks_plan() {
        // Pinned like `golden_plan`.
        let objects = Objects { of_sample: GOLDEN_OF_SAMPLE, bytes: GOLDEN_BYTES };
        let options =
            PlanOptions { batch_size: 4, seed: 42, shuffle: Shuffle::Blocks, block_bytes: 100, drop_last: false };
        let plan = EpochPlan::of_objects(&objects, 3, options).unwrap();
        assert_eq!(plan.order(), GOLDEN_BLOCKS_EPOCH3);
        assert_eq!(plan.batches(), 4);
        let plan = EpochPlan::of_objects(&objects, 4, options).unwrap();
        assert_eq!(plan.order(), GOLDEN_BLOCKS_EPOCH4);
        let dropped = EpochPlan::of_objects(&objects, 4, PlanOptions { drop_last: true, ..options }).unwrap();
        assert_eq!(dropped.order(), &GOLDEN_BLOCKS_EPOCH4[..12]);
    }

    // Computed by an independent Python implementation of the algorithm in the module note. Epoch 3: objects
    // shuffled to [1, 0, 4, 5, 2], blocks [1, 0] (80 bytes), [4] (120, alone), [5, 2] (60).
    const GOLDEN_BLOCKS_EPOCH3: &[u32] = &[1, 0, 3, 4, 2, 13, 9, 12, 7, 6, 8, 10, 11, 5];
    // Epoch 4: objects [2, 5, 1, 4, 0], blocks [2, 5], [1], [4], [0].
    const GOLDEN_BLOCKS_EPOCH4: &[u32] = &[5, 10, 11, 8, 3, 2, 4, 13, 12, 6, 7, 0, 1, 9];

    #[test]
    fn blocks_need_objects_and_a_size() {
        let options = PlanOptions { shuffle: Shuffle::Blocks, block_bytes: 1 << 30, ..PlanOptions::default() };
        assert_eq!(EpochPlan::new(10, 0, options), Err(PlanError::BlocksNeedObjects));
        let objects = Objects { of_sample: GOLDEN_OF_SAMPLE, bytes: GOLDEN_BYTES };
        let no_size = PlanOptions { block_bytes: 0, ..options };
        assert_eq!(EpochPlan::of_objects(&objects, 0, no_size), Err(PlanError::NoBlockBytes));
        assert_eq!(
            EpochPlan::of_objects(&objects, MAX_EPOCH + 1, options),
            Err(PlanError::EpochOutOfRange(MAX_EPOCH + 1))
        );
        let stray = Objects { of_sample: &[0, 2, 1], bytes: &[5, 5] };
        let err = EpochPlan::of_objects(&stray, 0, options).unwrap_err();
        assert_eq!(err, PlanError::NoSuchObject { sample: 1, object: 2, objects: 2 });
        assert_eq!(err.to_string(), "sample 1 lives in object 2, but the dataset has 2 objects");
        let empty = EpochPlan::of_objects(&Objects { of_sample: &[], bytes: &[] }, 0, options).unwrap();
        assert_eq!(empty.batches(), 0);
    }

    #[test]
    fn shuffle_modes_read_and_write_one_way() {
        for mode in [Shuffle::Global, Shuffle::None, Shuffle::Blocks] {
            assert_eq!(mode.to_string().parse::<Shuffle>(), Ok(mode));
            assert_eq!(serde_json::to_string(&mode).unwrap(), format!("\"{mode}\""));
        }
        assert_eq!(
            "local".parse::<Shuffle>().unwrap_err().to_string(),
            "shuffle must be `global`, `none` or `blocks`, got \"local\""
        );
    }

    #[test]
    fn block_bytes_is_left_out_of_json_when_not_given() {
        let old = r#"{"batch_size":256,"seed":0,"shuffle":"global","drop_last":false}"#;
        assert_eq!(serde_json::to_string(&PlanOptions::default()).unwrap(), old);
        assert_eq!(serde_json::from_str::<PlanOptions>(old).unwrap(), PlanOptions::default());
        let blocks = PlanOptions { shuffle: Shuffle::Blocks, block_bytes: 4 << 30, ..PlanOptions::default() };
        let json = serde_json::to_string(&blocks).unwrap();
        assert!(json.ends_with(r#""shuffle":"blocks","drop_last":false,"block_bytes":4294967296}"#), "{json}");
        assert_eq!(serde_json::from_str::<PlanOptions>(&json).unwrap(), blocks);
    }

    /// A realistic layout: 200 shards of 20 to 300 MB, Pareto-tailed (α = 1.1, cut at 300 MB), of 800 to
    /// 1,200 samples each, a shard's samples numbered one after another, as an index lists them.
    fn shards() -> (Vec<u32>, Vec<u64>) {
        const MB: f64 = 1e6;
        let mut rng = SplitMix64::new(7);
        let (mut of_sample, mut bytes) = (Vec::new(), Vec::new());
        for k in 0..200u32 {
            let size = (20.0 * MB / (1.0 - rng.next_f64()).powf(1.0 / 1.1)).min(300.0 * MB);
            bytes.push(size as u64);
            of_sample.extend(std::iter::repeat_n(k, 800 + rng.below(401) as usize));
        }
        (of_sample, bytes)
    }

    /// The figures the docs compare (run with `--nocapture` to read them); only what must hold is asserted.
    #[test]
    fn blocks_mix_less_than_global_and_more_than_none() {
        let (of_sample, bytes) = shards();
        let objects = Objects { of_sample: &of_sample, bytes: &bytes };
        let total: u64 = bytes.iter().sum();
        let (min, max) = (bytes.iter().min().unwrap(), bytes.iter().max().unwrap());
        println!("{} samples in {} objects of {min} to {max} bytes, {total} in all", of_sample.len(), bytes.len());
        let base = PlanOptions { batch_size: 256, seed: 1, block_bytes: total / 4, ..PlanOptions::default() };
        let figures = |shuffle| {
            let plan = EpochPlan::of_objects(&objects, 0, PlanOptions { shuffle, ..base }).unwrap();
            let r = randomness(&plan, &objects);
            println!(
                "shuffle={shuffle:<6} block_bytes={}: spread {:.4}, same-object pairs {:.5}, objects per batch {:.1}",
                base.block_bytes, r.spread, r.same_object, r.objects_per_batch
            );
            r
        };
        let (global, blocks, none) = (figures(Shuffle::Global), figures(Shuffle::Blocks), figures(Shuffle::None));
        assert!(blocks.spread < global.spread);
        assert!(blocks.same_object > global.same_object);
        assert!(none.same_object > blocks.same_object);
    }

    #[test]
    fn randomness_of_known_orders() {
        let objects = Objects { of_sample: &[0, 0, 1, 1], bytes: &[10, 10] };
        let none = EpochPlan::of_objects(
            &objects,
            0,
            PlanOptions { batch_size: 2, shuffle: Shuffle::None, ..PlanOptions::default() },
        )
        .unwrap();
        let r = randomness(&none, &objects);
        assert_eq!((r.spread, r.same_object, r.objects_per_batch), (1.0 / 3.0, 1.0, 1.0));
        let one = EpochPlan::of_objects(
            &objects,
            0,
            PlanOptions { batch_size: 4, shuffle: Shuffle::None, ..PlanOptions::default() },
        )
        .unwrap();
        let r = randomness(&one, &objects);
        assert_eq!((r.same_object, r.objects_per_batch), (2.0 / 6.0, 2.0));
        let empty = Objects { of_sample: &[], bytes: &[] };
        let r = randomness(&EpochPlan::of_objects(&empty, 0, PlanOptions::default()).unwrap(), &empty);
        assert_eq!((r.spread, r.same_object, r.objects_per_batch), (0.0, 0.0, 0.0));
    }

    #[test]
    fn no_shuffle_is_index_order_and_drop_last_drops() {
        let options = PlanOptions { batch_size: 3, seed: 9, shuffle: Shuffle::None, drop_last: true, block_bytes: 0 };
        let plan = EpochPlan::new(10, 0, options).unwrap();
        assert_eq!(plan.order(), &[0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(plan.batches(), 3);
        assert!(matches!(plan.batch(3), Err(PlanError::NoSuchBatch { batches: 3, .. })));
    }

    #[test]
    fn rejects_bad_options() {
        let zero = PlanOptions { batch_size: 0, ..PlanOptions::default() };
        assert_eq!(EpochPlan::new(5, 0, zero), Err(PlanError::BadBatchSize(0)));
        assert_eq!(
            EpochPlan::new(5, MAX_EPOCH + 1, PlanOptions::default()),
            Err(PlanError::EpochOutOfRange(MAX_EPOCH + 1))
        );
    }

    proptest! {
        #[test]
        fn every_sample_once(n in 0u32..2000, epoch in 0u64..50, seed: u64, bs in 1u32..300, global: bool) {
            let shuffle = if global { Shuffle::Global } else { Shuffle::None };
            let options = PlanOptions { batch_size: bs, seed, shuffle, drop_last: false, block_bytes: 0 };
            let plan = EpochPlan::new(n, epoch, options).unwrap();
            let mut seen: Vec<u32> = (0..plan.batches()).flat_map(|b| plan.batch(b).unwrap().to_vec()).collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..n).collect::<Vec<_>>());
            prop_assert_eq!(plan.clone(), EpochPlan::new(n, epoch, options).unwrap());
        }

        #[test]
        fn epochs_differ(n in 20u32..2000, epoch in 0u64..1000, seed: u64) {
            let options = PlanOptions { seed, ..PlanOptions::default() };
            let a = EpochPlan::new(n, epoch, options).unwrap();
            let b = EpochPlan::new(n, epoch + 1, options).unwrap();
            prop_assert_ne!(a.order(), b.order());
        }

        #[test]
        fn blocks_plan_every_sample_once_a_block_in_use_at_a_time(
            (of_sample, bytes) in objects(0..600, 1..40),
            block_bytes in 1u64..5000,
            epoch in 0u64..50,
            seed: u64,
            bs in 1u32..100,
            drop_last: bool,
        ) {
            let objects = Objects { of_sample: &of_sample, bytes: &bytes };
            let options = PlanOptions { batch_size: bs, seed, shuffle: Shuffle::Blocks, drop_last, block_bytes };
            let plan = EpochPlan::of_objects(&objects, epoch, options).unwrap();
            let whole = EpochPlan::of_objects(&objects, epoch, PlanOptions { drop_last: false, ..options }).unwrap();
            let mut seen: Vec<u32> = (0..whole.batches()).flat_map(|b| whole.batch(b).unwrap().to_vec()).collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..of_sample.len() as u32).collect::<Vec<_>>());
            let kept = of_sample.len() / bs as usize * bs as usize;
            prop_assert_eq!(plan.order(), if drop_last { &whole.order()[..kept] } else { whole.order() });
            // In use at position p: the objects whose first and last samples are at or either side of p.
            let order = plan.order();
            let (mut first, mut last) = (vec![usize::MAX; bytes.len()], vec![0; bytes.len()]);
            for (p, &s) in order.iter().enumerate() {
                let k = of_sample[s as usize] as usize;
                first[k] = first[k].min(p);
                last[k] = p;
            }
            for p in 0..order.len() {
                let in_use: Vec<usize> = (0..bytes.len()).filter(|&k| first[k] <= p && p <= last[k]).collect();
                let sum: u64 = in_use.iter().map(|&k| bytes[k]).sum();
                prop_assert!(
                    sum <= block_bytes || (in_use.len() == 1 && bytes[in_use[0]] > block_bytes),
                    "position {}: objects {:?} hold {} bytes, over {}", p, in_use, sum, block_bytes
                );
            }
            prop_assert_eq!(plan, EpochPlan::of_objects(&objects, epoch, options).unwrap());
        }

        #[test]
        fn blocks_epochs_differ(
            (mut of_sample, bytes) in objects(20..600, 2..40),
            block_bytes in 1u64..5000,
            epoch in 0u64..1000,
            seed: u64,
        ) {
            // At least two objects hold samples.
            (of_sample[0], of_sample[1]) = (0, 1);
            let objects = Objects { of_sample: &of_sample, bytes: &bytes };
            let options = PlanOptions { seed, shuffle: Shuffle::Blocks, block_bytes, ..PlanOptions::default() };
            let a = EpochPlan::of_objects(&objects, epoch, options).unwrap();
            let b = EpochPlan::of_objects(&objects, epoch + 1, options).unwrap();
            prop_assert_ne!(a.order(), b.order());
        }

        #[test]
        fn of_objects_plans_global_and_none_as_new_does(
            (of_sample, bytes) in objects(0..600, 1..40),
            epoch in 0u64..50,
            seed: u64,
            bs in 1u32..100,
            global: bool,
            drop_last: bool,
            block_bytes: u64,
        ) {
            let shuffle = if global { Shuffle::Global } else { Shuffle::None };
            let options = PlanOptions { batch_size: bs, seed, shuffle, drop_last, block_bytes };
            let objects = Objects { of_sample: &of_sample, bytes: &bytes };
            prop_assert_eq!(
                EpochPlan::of_objects(&objects, epoch, options).unwrap(),
                EpochPlan::new(of_sample.len() as u32, epoch, options).unwrap()
            );
        }

        #[test]
        fn drop_last_batches_are_full(n in 0u32..1000, bs in 1u32..100) {
            let options = PlanOptions { batch_size: bs, drop_last: true, ..PlanOptions::default() };
            let plan = EpochPlan::new(n, 0, options).unwrap();
            prop_assert_eq!(plan.batches(), u64::from(n / bs));
            for b in 0..plan.batches() {
                prop_assert_eq!(plan.batch(b).unwrap().len(), bs as usize);
            }
        }
    }
}
