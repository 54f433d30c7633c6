//! What the epoch folders tell the prefetcher: a listing is one epoch's batches in one format (its part the
//! format's place in [`BatchFormat::ALL`]), its objects the batches of the epoch's manifest, each fetched
//! whole (`GET .../epochs/E/batches/B.FORMAT`) and kept in the node cache as itself. Windows are as deep in
//! bytes as `prefetch_bytes` and run on into the next epoch; a listing of DALI index twins is asked for
//! whole at its first read, and a reader of this epoch's twins gets the next epoch's warmed with it.

use crate::client::Request;
use crate::prefetch::kinds::{Follow, Kind, Object, Objects, OnDisk, Warming};
use crate::prefetch::{Listing, NextEpoch, ObjectKey, Prefetcher, ReadError};
use batchfs::api::Manifest;
use batchfs::encode::BatchFormat;
use futures_util::future::BoxFuture;
use std::sync::Arc;

/// The kind of the epoch folders' listings.
pub struct EpochBatches {
    name: &'static str,
}

pub static BATCHES: EpochBatches = EpochBatches { name: "epoch folders" };

/// The listing of epoch `epoch`'s batches in `format`.
pub const fn listing(epoch: u64, format: BatchFormat) -> Listing {
    let mut part = 0;
    while BatchFormat::ALL[part] as u8 != format as u8 {
        part += 1;
    }
    Listing::new(&BATCHES, epoch, part as u64)
}

/// Batch `batch` of epoch `epoch` in `format`.
pub const fn key(epoch: u64, batch: u64, format: BatchFormat) -> ObjectKey {
    ObjectKey { listing: listing(epoch, format), index: batch }
}

fn format_of(listing: Listing) -> BatchFormat {
    BatchFormat::ALL[listing.part as usize]
}

impl Kind for EpochBatches {
    fn name(&self) -> &'static str {
        self.name
    }

    fn describe(&self, listing: Listing, index: u64) -> String {
        format!("batch {index} of epoch {} ({})", listing.epoch, format_of(listing))
    }

    fn objects(&self, p: &Prefetcher, listing: Listing) -> Result<Arc<dyn Objects>, ReadError> {
        Ok(Arc::new(Batches(p.manifest(listing.epoch, format_of(listing))?)))
    }

    fn follow(&self, listing: Listing) -> Follow {
        Follow { streams: true, by_bytes: true, all_at_first: format_of(listing).is_index(), into_next_epoch: true }
    }

    fn warming(&self, p: &Prefetcher, next: Listing) -> Warming {
        let NextEpoch { cached, twins } = p.next_epoch_manifests(next.epoch, format_of(next));
        Warming {
            cached: cached.map(|m| Arc::new(Batches(m)) as Arc<dyn Objects>),
            whole: twins.map(|idx| listing(next.epoch, idx)).into_iter().collect(),
        }
    }

    fn fetch(&self, p: Arc<Prefetcher>, listing: Listing) -> BoxFuture<'static, Result<Arc<dyn Objects>, ReadError>> {
        Box::pin(async move {
            let manifest = p.fetch_manifest(listing.epoch, format_of(listing)).await?;
            Ok(Arc::new(Batches(manifest)) as Arc<dyn Objects>)
        })
    }
}

/// An epoch's batches in one format: its manifest.
pub struct Batches(pub Arc<Manifest>);

impl Objects for Batches {
    fn count(&self) -> u64 {
        self.0.batches.len() as u64
    }

    fn bytes(&self) -> u64 {
        self.0.bytes
    }

    fn object(&self, index: u64) -> Option<Object> {
        let b = self.0.batches.get(index as usize)?;
        Some(Object { sent: crate::client::Sent { bytes: b.bytes, crc32c: b.crc32c }, placed: None, whole: true })
    }

    fn request(&self, index: u64) -> Option<Request> {
        Some(Request::Batch { epoch: self.0.epoch, batch: index, format: self.0.format })
    }

    fn on_disk(&self, index: u64, obj: &Object) -> Option<OnDisk> {
        Some(OnDisk { pieces: vec![crate::node_cache::Key::batch(obj.sent, &self.0, index)], within: None })
    }
}
