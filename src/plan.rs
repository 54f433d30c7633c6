//! Epoch plans: which samples form batch `i` of epoch `e`.
//!
//! A plan is a pure function of (number of samples, epoch, [`PlanOptions`]); client and server compute
//! the same one on any machine and version. The algorithm, pinned by a golden test:
//!
//! 1. `order = [0, 1, ..., n-1]`.
//! 2. With `shuffle = global`: seed a SplitMix64 generator with
//!    `seed ^ (epoch + 1) * 0x9E3779B97F4A7C15` (wrapping), then for `i` from `n-1` down to `1` draw
//!    `j` uniformly in `[0, i]` and swap `order[i]`, `order[j]` (Fisher–Yates). `j` is drawn by Lemire's
//!    multiply-shift with rejection: `m = x * (i+1)` as 128 bits; while `(m as u64) < (2^64 - (i+1)) %
//!    (i+1)`, draw again; `j = m >> 64`.
//! 3. Batch `b` holds `order[b*batch_size .. min((b+1)*batch_size, n)]`; with `drop_last` an incomplete
//!    last batch is dropped.
//!
//! SplitMix64 (Steele, Lea, Flood 2014): `state += 0x9E3779B97F4A7C15; z = state;
//! z = (z ^ z>>30) * 0xBF58476D1CE4E5B9; z = (z ^ z>>27) * 0x94D049BB133111EB; return z ^ z>>31`.

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
}

impl fmt::Display for Shuffle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Shuffle::Global => "global",
            Shuffle::None => "none",
        })
    }
}

impl FromStr for Shuffle {
    type Err = PlanError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "global" => Ok(Shuffle::Global),
            "none" => Ok(Shuffle::None),
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
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { batch_size: DEFAULT_BATCH_SIZE, seed: 0, shuffle: Shuffle::Global, drop_last: false }
    }
}

/// Invalid plan options.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    #[error("batch_size must be between 1 and {MAX_BATCH_SIZE}, got {0}")]
    BadBatchSize(u64),
    #[error("epoch must be between 0 and {MAX_EPOCH}, got {0}")]
    EpochOutOfRange(u64),
    #[error("shuffle must be `global` or `none`, got {0:?}")]
    BadShuffle(String),
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

/// The plan of one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochPlan {
    pub epoch: u64,
    pub options: PlanOptions,
    /// Sample indices in epoch order (trimmed when `drop_last` drops a partial batch).
    order: Vec<u32>,
}

impl EpochPlan {
    /// Plans epoch `epoch` over `samples` samples.
    pub fn new(samples: u32, epoch: u64, options: PlanOptions) -> Result<Self, PlanError> {
        options.validate()?;
        if epoch > MAX_EPOCH {
            return Err(PlanError::EpochOutOfRange(epoch));
        }
        let mut order: Vec<u32> = (0..samples).collect();
        if options.shuffle == Shuffle::Global {
            let mut rng = SplitMix64::new(options.seed ^ (epoch + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            for i in (1..order.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
        }
        if options.drop_last {
            let keep = order.len() / options.batch_size as usize * options.batch_size as usize;
            order.truncate(keep);
        }
        Ok(EpochPlan { epoch, options, order })
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_plan() {
        // Pinned: changing these numbers breaks every client/server pair across versions.
        let options = PlanOptions { batch_size: 4, seed: 42, shuffle: Shuffle::Global, drop_last: false };
        let plan = EpochPlan::new(10, 3, options).unwrap();
        assert_eq!(plan.order(), GOLDEN_10_SEED42_EPOCH3);
        assert_eq!(plan.batches(), 3);
        assert_eq!(plan.batch(2).unwrap().len(), 2);
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    // Computed by an independent Python implementation of the algorithm in the module note.
    const GOLDEN_10_SEED42_EPOCH3: &[u32] = &[4, 6, 8, 9, 3, 2, 5, 1, 7, 0];

    #[test]
    fn no_shuffle_is_index_order_and_drop_last_drops() {
        let options = PlanOptions { batch_size: 3, seed: 9, shuffle: Shuffle::None, drop_last: true };
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
            let options = PlanOptions { batch_size: bs, seed, shuffle, drop_last: false };
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
