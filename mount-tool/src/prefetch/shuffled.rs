//! `shuffled/`'s plans as the prefetcher keeps them: each epoch's samples of each class, in the plan's order,
//! as this mount's share of them, cut into groups of a few samples of one class, each with its size and
//! CRC32C. What a group is to the prefetcher, and the reads of samples from their groups, are `shuffled/`'s
//! to say (`fs/views/shuffled/groups.rs`); what each open gets is the filesystem's (`fs/views/shuffled.rs`).
//!
//! **Plans.** The sample table (every sample's class, size and CRC32C) is fetched once. An epoch's plan is
//! the core's [`EpochPlan`] over all samples (the mount's `seed` and `shuffle`; `batch_size` and
//! `drop_last` play no part: every sample is served), split by class, then by share: with `share=R/W`
//! this mount keeps the positions `j ≡ R (mod W)` of each class's list. Plans of the last few epochs are
//! kept; they are computed here, not asked of the server.

use super::retry::{with_retries, Failure};
use super::{Prefetcher, ReadError};
use crate::client::Sent;
use crate::sync::{Arc, Mutex};
use batchfs::api::SampleTable;
use batchfs::plan::{EpochPlan, PlanOptions};
use lru::LruCache;

/// Plans kept at once: the epoch being read and the next one.
const PLANS_KEPT: usize = 4;

/// Groups a class's window ahead of its cursor spans at least.
pub const WINDOW_GROUPS: u64 = 2;

/// How far the windows grow, reads of a class having stalled: at most this many times [`WINDOW_GROUPS`]
/// groups. Groups are sized so that the windows at their least hold this fraction of `prefetch_bytes`, and
/// at their most all of it.
pub const WINDOW_GROWTH: u64 = 4;

/// One epoch of `shuffled/` for this mount's share.
#[derive(Debug)]
pub struct ClassPlan {
    pub epoch: u64,
    /// Per class, the sample ids this mount serves, in plan order.
    pub order: Vec<Vec<u32>>,
    /// Per class, each group's size and CRC32C.
    pub groups: Vec<Vec<Sent>>,
    /// Samples per group.
    pub group: usize,
    /// Groups a class's window may grow to: [`WINDOW_GROUPS`] times [`WINDOW_GROWTH`] at most, fewer where
    /// all classes' windows would then hold more than `prefetch_bytes` (many classes, a sample a group),
    /// never fewer than [`WINDOW_GROUPS`].
    pub most_window: u64,
    /// Per (class, group): whether the node cache holds every sample of it (asked once; see
    /// `fs/views/shuffled/groups.rs`).
    pub on_disk: Mutex<std::collections::HashMap<(usize, u64), bool>>,
}

impl ClassPlan {
    /// Group `g` of class `c`: its sample ids.
    pub fn group_ids(&self, class: usize, g: u64) -> &[u32] {
        let order = &self.order[class];
        let start = (g as usize * self.group).min(order.len());
        &order[start..(start + self.group).min(order.len())]
    }
}

/// What `shuffled/` needs of the dataset and of the mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShuffledConfig {
    pub plan: PlanOptions,
    /// This mount's share `(rank, world)` of each class.
    pub share: (u32, u32),
}

impl Default for ShuffledConfig {
    fn default() -> Self {
        ShuffledConfig { plan: PlanOptions::default(), share: (0, 1) }
    }
}

/// The room's state.
#[derive(Default)]
pub(super) struct Shuffled {
    table: std::sync::OnceLock<Arc<SampleTable>>,
    plans: Mutex<Option<LruCache<u64, Arc<ClassPlan>>>>,
    /// Serializes the computation of plans (one at a time; readers of a computed one do not wait).
    making: Mutex<()>,
}

/// Samples per group for a dataset of `classes` classes of `mean` bytes a sample: enough that the windows
/// of all classes together hold about `window_bytes` (each class [`WINDOW_GROUPS`] groups), 1 to 64.
pub fn group_size(window_bytes: u64, classes: usize, mean: u64) -> usize {
    let per_class = window_bytes / (classes.max(1) as u64 * WINDOW_GROUPS * mean.max(1));
    per_class.clamp(1, 64) as usize
}

/// Groups a class's window may grow to ([`ClassPlan::most_window`]) where all `classes` windows of groups
/// of `group` samples of `mean` bytes hold at most `window_bytes`.
pub fn most_window(window_bytes: u64, classes: usize, group: usize, mean: u64) -> u64 {
    let fits = window_bytes / (classes.max(1) as u64 * group.max(1) as u64 * mean.max(1));
    fits.clamp(WINDOW_GROUPS, WINDOW_GROUPS * WINDOW_GROWTH)
}

/// The plan of `epoch` over `table`'s samples for `config`'s share, in groups of `group`.
pub fn class_plan(table: &SampleTable, classes: usize, epoch: u64, config: ShuffledConfig, group: usize) -> ClassPlan {
    let options = PlanOptions { drop_last: false, ..config.plan.per_sample() };
    let plan = EpochPlan::new(table.len() as u32, epoch, options).expect("validated options, an epoch in range");
    let mut all: Vec<Vec<u32>> = vec![Vec::new(); classes];
    for &id in plan.order() {
        if let Some(list) = all.get_mut(table.labels[id as usize] as usize) {
            list.push(id);
        }
    }
    let (rank, world) = (config.share.0 as usize, config.share.1.max(1) as usize);
    let order: Vec<Vec<u32>> =
        all.into_iter().map(|list| list.into_iter().skip(rank).step_by(world).collect()).collect();
    let groups = order
        .iter()
        .map(|ids| {
            ids.chunks(group)
                .map(|g| {
                    g.iter().fold(Sent { bytes: 0, crc32c: 0 }, |acc, &id| {
                        let (bytes, crc) = (table.bytes[id as usize], table.crc32c[id as usize]);
                        Sent { bytes: acc.bytes + bytes, crc32c: batchfs::crc::combine(acc.crc32c, crc, bytes) }
                    })
                })
                .collect()
        })
        .collect();
    ClassPlan { epoch, order, groups, group, most_window: WINDOW_GROUPS, on_disk: Mutex::default() }
}

impl Prefetcher {
    /// The sample table (fetched once, with retries up to `timeout`). Blocks like
    /// [`Prefetcher::manifest`]. A table of another index than the mount's fails at once and is not kept:
    /// its samples are not the ones the directories list (names, sizes, classes).
    pub fn sample_table(&self) -> Result<Arc<SampleTable>, ReadError> {
        if let Some(t) = self.shuffled.table.get() {
            return Ok(t.clone());
        }
        let client = self.client.clone();
        let table = self.runtime.block_on(with_retries(&self.config, &self.stats, move |_| {
            let client = client.clone();
            async move { client.sample_table().await.map_err(Failure::Client) }
        }))?;
        if let Some(changed) = self.config.changed(&table.index_id, "sample table") {
            return Err(changed);
        }
        Ok(self.shuffled.table.get_or_init(|| Arc::new(table)).clone())
    }

    /// `shuffled/`'s plan of `epoch` for `classes` classes (computed once, the last few kept).
    pub fn class_plan(&self, epoch: u64, classes: usize) -> Result<Arc<ClassPlan>, ReadError> {
        let cached = |s: &Shuffled| s.plans.lock().expect("plans").get_or_insert_with(new_plans).get(&epoch).cloned();
        if let Some(p) = cached(&self.shuffled) {
            return Ok(p);
        }
        let table = self.sample_table()?;
        let _making = self.shuffled.making.lock().expect("making");
        if let Some(p) = cached(&self.shuffled) {
            return Ok(p);
        }
        let mean = table.bytes.iter().sum::<u64>() / table.len().max(1) as u64;
        // The windows start small (a fresh mount's window is new memory, and its first reads wait for their
        // groups whole): they grow where reads stall (`fs/views/shuffled/state.rs`).
        let group = group_size(self.config.prefetch_bytes / WINDOW_GROWTH, classes, mean);
        let mut plan = class_plan(&table, classes, epoch, self.config.shuffled, group);
        plan.most_window = most_window(self.config.prefetch_bytes, classes, group, mean);
        let plan = Arc::new(plan);
        self.shuffled.plans.lock().expect("plans").get_or_insert_with(new_plans).put(epoch, plan.clone());
        Ok(plan)
    }

    /// The sample table, if fetched.
    pub(crate) fn shuffled_table(&self) -> Option<Arc<SampleTable>> {
        self.shuffled.table.get().cloned()
    }

    /// This mount's share of `shuffled/`: `(rank, world)`.
    pub fn shuffled_share(&self) -> (u32, u32) {
        self.config.shuffled.share
    }

    /// The plan of a listing of `shuffled/`, if computed (a fetch's sample ids come from it).
    pub(crate) fn cached_class_plan(&self, epoch: u64) -> Option<Arc<ClassPlan>> {
        self.shuffled.plans.lock().expect("plans").as_mut().and_then(|p| p.peek(&epoch).cloned())
    }
}

fn new_plans() -> LruCache<u64, Arc<ClassPlan>> {
    LruCache::new(std::num::NonZeroUsize::new(PLANS_KEPT).expect("nonzero"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchfs::plan::Shuffle;
    use proptest::prelude::*;

    fn table(labels: &[u32]) -> SampleTable {
        SampleTable {
            labels: labels.to_vec(),
            crc32c: labels.iter().enumerate().map(|(i, _)| i as u32 * 7).collect(),
            bytes: labels.iter().enumerate().map(|(i, _)| 100 + i as u64).collect(),
            index_id: String::new(),
        }
    }

    proptest! {
        /// Every sample of every class is in exactly one share's list, once, each list in plan order; the
        /// groups cover the lists, with their samples' sizes and combined CRCs.
        #[test]
        fn shares_partition_each_class_in_plan_order(
            labels in proptest::collection::vec(0u32..5, 1..300),
            world in 1u32..5,
            group in 1usize..9,
            epoch in 0u64..4,
        ) {
            let t = table(&labels);
            let plan_order = EpochPlan::new(t.len() as u32, epoch, PlanOptions::default()).unwrap().order().to_vec();
            let mut seen = vec![0u32; labels.len()];
            for rank in 0..world {
                let config = ShuffledConfig { plan: PlanOptions::default(), share: (rank, world) };
                let p = class_plan(&t, 5, epoch, config, group);
                for (c, ids) in p.order.iter().enumerate() {
                    prop_assert!(ids.iter().all(|&i| labels[i as usize] == c as u32));
                    let pos: Vec<usize> = ids.iter().map(|i| plan_order.iter().position(|x| x == i).unwrap()).collect();
                    prop_assert!(pos.windows(2).all(|w| w[0] < w[1]), "plan order");
                    for &i in ids {
                        seen[i as usize] += 1;
                    }
                    prop_assert_eq!(p.groups[c].len(), ids.len().div_ceil(group));
                    for (g, sent) in p.groups[c].iter().enumerate() {
                        let members = p.group_ids(c, g as u64);
                        let bytes: u64 = members.iter().map(|&i| t.bytes[i as usize]).sum();
                        prop_assert_eq!(sent.bytes, bytes);
                    }
                }
            }
            prop_assert!(seen.iter().all(|&n| n == 1), "each sample in one share, once: {:?}", seen);
        }
    }

    /// A sample table of another index than the mount's (the dataset indexed again with other files) fails
    /// at once and is not kept: `shuffled/`'s plans are never made of it, and the names the directories
    /// listed are never paired with another index's samples. The mount's index's table is kept.
    #[test]
    fn a_sample_table_of_another_index_fails_at_once_and_is_not_kept() {
        let ids = ("0000000000000002", "0000000000000001");
        let (_runtime, client, p) = super::super::tests::of_files(&["a/x.jpg", "b/y.jpg"], b"12", ids);
        let started = std::time::Instant::now();
        let err = p.class_plan(0, 2).unwrap_err();
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "at once, not after timeout");
        let ReadError::Changed { was, now, reply, .. } = &err else { panic!("{err}") };
        assert_eq!(
            (was.as_str(), now.as_str(), reply.as_str()),
            ("0000000000000001", "0000000000000002", "sample table")
        );
        assert!(p.shuffled_table().is_none() && p.cached_class_plan(0).is_none(), "nothing of it kept");
        *client.index_id.lock().unwrap() = "0000000000000001".into();
        assert_eq!(p.sample_table().unwrap().len(), 2, "the mount's index: kept");
        assert!(p.class_plan(0, 2).is_ok());
    }

    #[test]
    fn each_epoch_has_its_own_order_and_none_without_shuffle() {
        let t = table(&[0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1]);
        let config = ShuffledConfig::default();
        let (a, b) = (class_plan(&t, 2, 0, config, 2), class_plan(&t, 2, 1, config, 2));
        assert_ne!(a.order, b.order);
        let none = ShuffledConfig { plan: PlanOptions { shuffle: Shuffle::None, ..PlanOptions::default() }, ..config };
        assert_eq!(class_plan(&t, 2, 5, none, 2).order, vec![vec![0, 2, 4, 6, 8, 10], vec![1, 3, 5, 7, 9, 11]]);
    }

    #[test]
    fn groups_are_sized_for_the_windows_of_every_class() {
        // 1,000 classes of 110 KB samples in a 128 MiB window: one sample a group, requests still batched by
        // class; 10 classes: 61; never more than 64.
        assert_eq!(group_size(128 << 20, 1000, 110_000), 1);
        assert_eq!(group_size(128 << 20, 10, 110_000), 61);
        assert_eq!(group_size(128 << 20, 1, 1), 64);
        assert_eq!(group_size(0, 0, 0), 1);
        // Ten classes: groups a quarter of the size, windows that grow to hold all of the bytes again.
        let group = group_size((128 << 20) / WINDOW_GROWTH, 10, 110_000);
        assert_eq!((group, most_window(128 << 20, 10, group, 110_000)), (15, 8));
        // ImageNet's thousand classes: a sample a group already, and no room to grow.
        assert_eq!(most_window(128 << 20, 1000, 1, 110_000), WINDOW_GROUPS);
        assert_eq!(most_window(1 << 30, 1000, 1, 110_000), 8, "with a larger prefetch_bytes, some");
    }
}
