//! What a view tells the prefetcher about its objects, behind two traits, so that the prefetcher matches on
//! no view. A view declares each kind of list it shows as a static [`Kind`] (in its folder under
//! `fs/views/`): the kind names its objects, gives the [`Objects`] of each of its listings (from what the
//! prefetcher holds of the server's answers, or fetched), says how the window follows reads of them
//! ([`Follow`]) and what warming a next epoch's listing needs. The objects describe each object: what the
//! server sends for it (size and CRC32C), how readers see it laid out, what to ask the server for, and
//! where on the node's disk it may be.
//!
//! A [`Listing`] is a kind, an epoch and a part the kind numbers (a format, a directory, a class): a key,
//! copied into every cache key, compared and hashed without asking the kind anything.

use super::{Prefetcher, ReadError};
use crate::client::{Request, Sent};
use crate::sync::Arc;
use batchfs::rolling::FileLayout;
use futures_util::future::BoxFuture;
use std::hash::{Hash, Hasher};

/// One kind of listing of a view (the batches of an epoch's folder, the chunks of a directory of `raw/`,
/// ...): a static of non-zero size, so that its address tells it from every other kind.
pub trait Kind: Sync + 'static {
    /// The view's name (`raw/`).
    fn name(&self) -> &'static str;

    /// Names object `index` of `listing` in messages (`batch 3 of epoch 0 (tfrecord)`).
    fn describe(&self, listing: Listing, index: u64) -> String;

    /// The objects of `listing`, from what the prefetcher holds or fetched now. Blocks: called from FUSE
    /// threads only, never from the runtime.
    fn objects(&self, p: &Prefetcher, listing: Listing) -> Result<Arc<dyn Objects>, ReadError>;

    /// How the window follows reads of the kind's listings.
    fn follow(&self, listing: Listing) -> Follow;

    /// What warming `next` needs, a next epoch's listing a window runs on into ([`Follow::into_next_epoch`]):
    /// its objects if they are at hand without blocking, and listings to fetch whole with it.
    fn warming(&self, _p: &Prefetcher, _next: Listing) -> Warming {
        Warming::default()
    }

    /// Fetches the objects of `listing`, a next epoch's (or one [`Warming::whole`] named), on the runtime.
    fn fetch(&self, _p: Arc<Prefetcher>, listing: Listing) -> BoxFuture<'static, Result<Arc<dyn Objects>, ReadError>> {
        Box::pin(std::future::ready(Err(ReadError::NotFound(format!("{listing:?}: not warmed ahead")))))
    }
}

/// The objects of one listing, by position, as a view describes them.
pub trait Objects: Send + Sync {
    /// How many there are.
    fn count(&self) -> u64;

    /// Their bytes, all together.
    fn bytes(&self) -> u64;

    /// Object `index`, if there is one.
    fn object(&self, index: u64) -> Option<Object>;

    /// What to ask the server for to fetch object `index` (`None`: nothing; a fetch of it fails).
    fn request(&self, index: u64) -> Option<Request>;

    /// Where object `index` (`obj`) may be in the node cache (`None`: nowhere there).
    fn on_disk(&self, _index: u64, _obj: &Object) -> Option<OnDisk> {
        None
    }

    /// Objects to fetch after a read of object `index`, besides the window's (the chunks of a directory's
    /// other DALI indexes at the first read of one).
    fn also_after(&self, _index: u64) -> Vec<u64> {
        Vec::new()
    }
}

/// What one object of a listing is: what the server sends for it, and what readers see.
#[derive(Debug, Clone)]
pub struct Object {
    /// The body the server sends.
    pub sent: Sent,
    /// Where the body's records go in the file readers see (`rolling/`'s indexed layout); none: the body is
    /// the file.
    pub placed: Option<Arc<FileLayout>>,
    /// The body is a whole file readers open (a batch, a `raw/` file of one chunk), which the kernel may be
    /// handed by passthrough; not a group of samples nor a chunk of a larger file.
    pub whole: bool,
}

/// The bytes of a page: a placed record's first and last pages are partly its own, and are counted whole.
const PAGE: u64 = 4096;

impl Object {
    /// The size of the file readers see.
    pub fn size(&self) -> u64 {
        self.placed.as_ref().map_or(self.sent.bytes, |l| l.len)
    }

    /// Bytes charged to the budget for it: the body, or, placed, its records and the pages they share
    /// with the holes around them.
    pub fn charge(&self) -> u64 {
        self.sent.bytes + self.placed.as_ref().map_or(0, |l| 2 * PAGE * l.slots.len() as u64)
    }
}

/// Where an object may be in the node cache: its pieces, each an object there (the object itself, or a
/// group's samples), or else a range of a whole object there (a chunk of a file warming kept whole).
#[derive(Debug, Clone)]
pub struct OnDisk {
    pub pieces: Vec<crate::node_cache::Key>,
    pub within: Option<(crate::node_cache::Key, u64)>,
}

/// How the window follows reads of a listing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Follow {
    /// Reads start streams whose windows the prefetcher fetches (false: the view keeps windows of its own).
    pub streams: bool,
    /// A stream's window holds `prefetch_bytes` at the listing's mean object size when that is more than
    /// `prefetch` objects (batches: small ones get windows as deep in bytes as large ones); false: `prefetch`
    /// objects (a file tree's files are single samples).
    pub by_bytes: bool,
    /// The first read of the listing asks for all of its objects (DALI reads every index twin at its
    /// pipeline build).
    pub all_at_first: bool,
    /// A window running past the listing's end runs on into the same listing of the next epoch.
    pub into_next_epoch: bool,
}

/// What warming a next epoch's listing needs.
#[derive(Default)]
pub struct Warming {
    /// Its objects, when at hand without fetching.
    pub cached: Option<Arc<dyn Objects>>,
    /// Listings to fetch whole with it (the next epoch's index twins, for a reader of this epoch's).
    pub whole: Vec<Listing>,
}

/// A list of objects the mount shows: a [`Kind`], an epoch, and a part the kind numbers.
#[derive(Clone, Copy)]
pub struct Listing {
    pub kind: &'static dyn Kind,
    pub epoch: u64,
    pub part: u64,
}

impl Listing {
    pub const fn new(kind: &'static dyn Kind, epoch: u64, part: u64) -> Self {
        Listing { kind, epoch, part }
    }

    /// The same listing of the next epoch, if there is one.
    pub fn next_epoch(self) -> Option<Listing> {
        (self.epoch < batchfs::plan::MAX_EPOCH).then(|| Listing { epoch: self.epoch + 1, ..self })
    }

    /// The kind's address: what tells kinds apart.
    fn kind_at(&self) -> usize {
        std::ptr::from_ref(self.kind).cast::<()>() as usize
    }
}

impl PartialEq for Listing {
    fn eq(&self, other: &Self) -> bool {
        self.kind_at() == other.kind_at() && self.epoch == other.epoch && self.part == other.part
    }
}

impl Eq for Listing {}

impl Hash for Listing {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self.kind_at(), self.epoch, self.part).hash(state);
    }
}

impl std::fmt::Debug for Listing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} listing (epoch {}, part {})", self.kind.name(), self.epoch, self.part)
    }
}
