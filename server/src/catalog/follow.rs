//! The disk tier of an object dataset following the plans whose batches are read: which order it copies
//! objects in, how far ahead of the reads, and which copies go first (`objects/stage.rs` does the rest).

use super::Dataset;
use batchfs::plan::{EpochPlan, Shuffle};

impl Dataset {
    /// Has the disk tier of an object dataset follow `plan`: its objects are copied in in the order the
    /// plan first reads them, all of them where the dataset fits in the tier, else under
    /// `shuffle=blocks` a block ahead of the reads (as far as the tier holds beside the two blocks being
    /// read: a mount's window reaches into the next block before the last one is done), the objects
    /// behind those two blocks the tier's first to go. Called as the plan's
    /// batches are read (each plan once): manifests are asked for epochs ahead of the one read.
    pub(super) fn follow(&self, epoch: u64, plan: &EpochPlan) {
        let Some(objects) = self.storage.objects() else { return };
        let Some(tier) = objects.tier() else { return };
        {
            let mut followed = self.followed.lock().expect("followed");
            if followed.contains(&(epoch, plan.options)) {
                return;
            }
            if followed.len() == 4 {
                followed.pop_front();
            }
            followed.push_back((epoch, plan.options));
        }
        let bytes = self.on_disk(tier);
        // Under `blocks`, what lies further behind the reads than the two blocks being read is evicted
        // first (its next read is in a later epoch).
        let (ahead, behind) = match plan.options.shuffle {
            _ if bytes <= tier.cap() => (u64::MAX, u64::MAX),
            Shuffle::Blocks => blocks_reach(tier.cap(), plan.options.block_bytes),
            _ => return,
        };
        objects.follow(plan.order(), ahead, behind);
    }
}

/// How far the disk tier's stager copies ahead of the reads of a `shuffle=blocks` dataset larger than the
/// tier (`tier` bytes, blocks of `block` bytes), and how far behind them its copies are the first to go:
/// the two blocks being read are kept (a mount's window reaches into the next block before the last one
/// is done) and the next one copied, as far as the tier holds beside them. What the tier holds beyond
/// those three blocks keeps copies from one epoch to the next.
fn blocks_reach(tier: u64, block: u64) -> (u64, u64) {
    let two_blocks = block.saturating_mul(2);
    (tier.saturating_sub(two_blocks).min(block), two_blocks)
}

#[cfg(test)]
mod tests {
    use super::blocks_reach;

    /// At the default `block_bytes` (a quarter of the tier) the stager copies one block ahead, so a
    /// quarter of the tier keeps copies from one epoch to the next. Before, it copied as far as the tier
    /// less two blocks: with blocks of a third, the window filled the tier and every epoch read the store
    /// whole (1.05x the dataset; 0.89x with the quarter kept, BENCHMARKS.md); with smaller blocks given, it
    /// filled the tier with this epoch's next blocks all the same.
    #[test]
    fn the_stager_copies_a_block_ahead_and_leaves_the_rest_of_the_tier_to_later_epochs() {
        let tier = 1200;
        let room = |block| tier - blocks_reach(tier, block).1 - blocks_reach(tier, block).0;
        assert_eq!(blocks_reach(tier, 300), (300, 600));
        assert_eq!(room(300), 300, "the default: a quarter of the tier kept");
        assert_eq!(blocks_reach(tier, 100), (100, 200));
        assert_eq!(room(100), 900);
        // A third, the most that fits: no room. Larger: what the tier holds beside the two blocks read.
        assert_eq!(blocks_reach(tier, 400), (400, 800));
        assert_eq!(blocks_reach(tier, 500), (200, 1000));
        assert_eq!(blocks_reach(tier, 700), (0, 1400));
    }
}
