//! What `rolling/`'s indexed layout tells the prefetcher: a listing is one epoch's files of the layout, each
//! made from the epoch's TFRecord batch (fetched whole as the epoch folders fetch it) by placing its records at
//! the slots of the slot table. A placed file is made here, so it is never looked for in the node cache.
//! Windows follow reads as the epoch folders' do, on into the next epoch.

use crate::client::{Request, Sent};
use crate::prefetch::kinds::{Follow, Kind, Object, Objects, Warming};
use crate::prefetch::{Listing, ObjectKey, Prefetcher, ReadError};
use batchfs::api::{Manifest, SlotTable};
use batchfs::encode::BatchFormat;
use batchfs::rolling::FileLayout;
use futures_util::future::BoxFuture;
use std::sync::Arc;

/// The kind of the indexed layout's listings.
pub struct PlacedBatches {
    name: &'static str,
}

pub static PLACED: PlacedBatches = PlacedBatches { name: "rolling/" };

/// File `batch` of the indexed layout as it serves epoch `epoch`.
pub fn key(epoch: u64, batch: u64) -> ObjectKey {
    ObjectKey { listing: Listing::new(&PLACED, epoch, 0), index: batch }
}

impl Kind for PlacedBatches {
    fn name(&self) -> &'static str {
        self.name
    }

    fn describe(&self, listing: Listing, index: u64) -> String {
        format!("rolling/ batch {index} of epoch {} (indexed)", listing.epoch)
    }

    fn objects(&self, p: &Prefetcher, listing: Listing) -> Result<Arc<dyn Objects>, ReadError> {
        let manifest = p.manifest(listing.epoch, BatchFormat::Tfrecord)?;
        Ok(Arc::new(Placed { manifest, table: p.slot_table()? }))
    }

    fn follow(&self, _listing: Listing) -> Follow {
        Follow { streams: true, by_bytes: true, all_at_first: false, into_next_epoch: true }
    }

    fn warming(&self, p: &Prefetcher, next: Listing) -> Warming {
        let cached = p.next_epoch_manifests(next.epoch, BatchFormat::Tfrecord).cached;
        let cached =
            cached.zip(p.cached_slot_table()).map(|(manifest, table)| Arc::new(Placed { manifest, table }) as _);
        Warming { cached, whole: Vec::new() }
    }

    fn fetch(&self, p: Arc<Prefetcher>, listing: Listing) -> BoxFuture<'static, Result<Arc<dyn Objects>, ReadError>> {
        Box::pin(async move {
            let manifest = p.fetch_manifest(listing.epoch, BatchFormat::Tfrecord).await?;
            Ok(Arc::new(Placed { manifest, table: p.fetch_slot_table().await? }) as Arc<dyn Objects>)
        })
    }
}

/// An epoch's TFRecord batches, each placed at its slots.
struct Placed {
    manifest: Arc<Manifest>,
    table: Arc<SlotTable>,
}

impl Objects for Placed {
    fn count(&self) -> u64 {
        self.manifest.batches.len() as u64
    }

    fn bytes(&self) -> u64 {
        self.manifest.bytes
    }

    fn object(&self, index: u64) -> Option<Object> {
        let b = self.manifest.batches.get(index as usize)?;
        let layout = FileLayout::new(index, self.table.batches.get(index as usize)?);
        Some(Object { sent: Sent { bytes: b.bytes, crc32c: b.crc32c }, placed: Some(Arc::new(layout)), whole: true })
    }

    fn request(&self, index: u64) -> Option<Request> {
        Some(Request::Batch { epoch: self.manifest.epoch, batch: index, format: BatchFormat::Tfrecord })
    }
}
