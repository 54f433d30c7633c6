//! Batches warmed ahead of the mounts' requests (`readahead_batches`): the storage ranges of the next
//! batches of a plan read into memory on the blocking pool, within the storage semaphore.

use super::AppState;
use crate::catalog::Dataset;
use batchfs::api::BatchQuery;
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
        let (state, ds, plan) = (state.clone(), ds.clone(), plan.clone());
        tokio::spawn(async move {
            let Ok(_permit) = state.stream.storage_permit().await else {
                return;
            };
            let _ = tokio::task::spawn_blocking(move || {
                // The samples' own ranges, from the index: no layout is built (its framing would take the
                // layouts' budget from the bodies it speeds up, a `tfrecord.slots` batch's padding most of
                // all), and the disk tier's stager hears of the batch from its body, not from this. Only what
                // is not in memory yet: asking the kernel to read ahead pages it holds still walks them (with
                // the page cache warm, that was 6 % of the server's CPU).
                let Ok(samples) = plan.batch(b) else { return };
                let parts = samples.iter().flat_map(|&i| &ds.index.samples[i as usize].parts);
                let ranges: Vec<(u32, u64, u64)> = parts
                    .map(|p| (p.shard, p.offset, p.len))
                    .filter(|&(shard, offset, len)| len > 0 && !ds.storage.nothing_to_read_ahead(shard, offset, len))
                    .collect();
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
