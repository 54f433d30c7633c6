//! Batches warmed ahead of the mounts' requests (`readahead_batches`): the storage ranges of the next
//! batches of a plan read into memory on the blocking pool, within the storage semaphore and the layouts'
//! budget.

use super::{AppState, Failure};
use crate::catalog::Dataset;
use batchfs::api::BatchQuery;
use batchfs::encode::Segment;
use std::sync::Arc;

/// Warms the storage ranges of the next `readahead_batches` batches of the same plan, each once, on
/// the blocking pool within the storage semaphore.
pub(super) fn warm_ahead(state: &Arc<AppState>, ds: &Arc<Dataset>, epoch: u64, batch: u64, query: BatchQuery) {
    // Direct reads bypass the page cache: there is nothing to warm (the mounts' windows ask for the
    // next batches themselves, and each body reads `read_depth` chunks ahead).
    if state.readahead_batches == 0 || ds.storage.direct() > 0 {
        return;
    }
    let Ok(plan) = ds.plan(epoch, &query) else {
        return;
    };
    let todo: Vec<u64> = {
        let mut warmed = state.warmed.lock().expect("warm cache");
        (batch + 1..=batch + state.readahead_batches)
            .filter(|&b| b < plan.batches())
            .filter(|&b| warmed.put((ds.name.clone(), epoch, query, b), ()).is_none())
            .collect()
    };
    for b in todo {
        let (state, ds) = (state.clone(), ds.clone());
        tokio::spawn(async move {
            let Ok(_permit) = state.stream.storage_permit().await else {
                return;
            };
            let _ = tokio::task::spawn_blocking(move || {
                // Within the layouts' budget, as bodies', and held only while its ranges are taken out of it:
                // the reads (of a bucket, GETs of seconds) hold none of it from the bodies they speed up. One
                // refused is not remembered as warmed.
                let what = format!("batch {b} of epoch {epoch} of dataset {:?}, warmed", ds.name);
                let layout =
                    state.framing.build(&what, |charge| Ok::<_, Failure>(ds.layout(epoch, b, &query, charge)?));
                let Ok((layout, held, _)) = layout else {
                    state.warmed.lock().expect("warm cache").pop(&(ds.name.clone(), epoch, query, b));
                    return;
                };
                // Only what is not in memory yet: asking the kernel to read ahead pages it holds still
                // walks them (with the page cache warm, that was 6 % of the server's CPU).
                let ranges: Vec<(u32, u64, u64)> = layout
                    .segments
                    .iter()
                    .filter_map(|s| match s {
                        Segment::Data { shard, offset, len } => Some((*shard, *offset, *len)),
                        Segment::Inline(_) => None,
                    })
                    .filter(|&(shard, offset, len)| !ds.storage.nothing_to_read_ahead(shard, offset, len))
                    .collect();
                drop((layout, held));
                if let Err(e) = ds.storage.warm_all(&ranges) {
                    tracing::debug!(dataset = %ds.name, error = %e, "cannot warm a batch");
                    return;
                }
                state.metrics.warmed_batches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
            .await;
        });
    }
}
