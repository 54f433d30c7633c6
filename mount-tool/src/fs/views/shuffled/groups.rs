//! What `shuffled/` tells the prefetcher: a listing is one class's groups in one epoch's plan (its part the
//! class), object `g` holding the class's samples `g·G .. (g+1)·G` in plan order, each group one data request
//! (`GET .../samples/data?ids=`), checked whole against the CRC32C the sample table gives (the samples' CRCs
//! combined). In the node cache a group is its samples, each kept as itself (a sample of a file tree is its
//! file, so `raw/` and `shuffled/` share what either fetched). The view keeps the classes' windows itself
//! ([`prefetch`]), so reads start no stream; a group whose samples have all been read leaves the cache at
//! once ([`Reads`]).

use crate::client::{Request, Sent};
use crate::prefetch::kinds::{Follow, Kind, Object, Objects, OnDisk};
use crate::prefetch::{ClassPlan, Listing, ObjectKey, Prefetcher, ReadError, Target};
use batchfs::api::SampleTable;
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The kind of `shuffled/`'s listings.
pub struct ClassGroups {
    name: &'static str,
}

pub static GROUPS: ClassGroups = ClassGroups { name: "shuffled/" };

fn listing(epoch: u64, class: usize) -> Listing {
    Listing::new(&GROUPS, epoch, class as u64)
}

impl Kind for ClassGroups {
    fn name(&self) -> &'static str {
        self.name
    }

    fn describe(&self, listing: Listing, index: u64) -> String {
        format!("group {index} of class #{} of epoch {} (shuffled/)", listing.part, listing.epoch)
    }

    fn objects(&self, p: &Prefetcher, listing: Listing) -> Result<Arc<dyn Objects>, ReadError> {
        let epoch = listing.epoch;
        let plan = p
            .cached_class_plan(epoch)
            .ok_or_else(|| ReadError::NotFound(format!("the plan of epoch {epoch} of shuffled/")))?;
        Ok(Arc::new(Groups::of(p, plan, listing.part as usize)))
    }

    fn follow(&self, _listing: Listing) -> Follow {
        Follow { streams: false, by_bytes: false, all_at_first: false, into_next_epoch: false }
    }
}

/// One class's groups of a plan, and the sample table when fetched (what finds a group's samples in the
/// node cache).
struct Groups {
    plan: Arc<ClassPlan>,
    class: usize,
    table: Option<Arc<SampleTable>>,
}

impl Groups {
    /// Class `class`'s groups of `plan`, with the sample table if `p` has fetched it.
    fn of(p: &Prefetcher, plan: Arc<ClassPlan>, class: usize) -> Self {
        Groups { plan, class, table: p.shuffled_table() }
    }

    fn groups(&self) -> &[Sent] {
        self.plan.groups.get(self.class).map_or(&[], Vec::as_slice)
    }
}

impl Objects for Groups {
    fn count(&self) -> u64 {
        self.groups().len() as u64
    }

    fn bytes(&self) -> u64 {
        self.groups().iter().map(|s| s.bytes).sum()
    }

    fn object(&self, index: u64) -> Option<Object> {
        Some(Object { sent: *self.groups().get(index as usize)?, placed: None, whole: false })
    }

    fn request(&self, index: u64) -> Option<Request> {
        Some(Request::Samples(self.plan.group_ids(self.class, index).into()))
    }

    fn on_disk(&self, index: u64, _obj: &Object) -> Option<OnDisk> {
        let table = self.table.as_ref()?;
        let ids = self.plan.group_ids(self.class, index);
        Some(OnDisk { pieces: ids.iter().map(|&i| key_of(table, i)).collect(), within: None })
    }
}

/// Starts fetching groups `groups` of class `class` in `plan`, ahead of its readers (those not cached or in
/// flight; none once the cache or the prefetch cap is full), but for groups whose samples opens take from
/// the node cache's disk (`on_disk`).
pub fn prefetch(p: &Arc<Prefetcher>, plan: &Arc<ClassPlan>, class: usize, groups: std::ops::Range<u64>) {
    let listing = listing(plan.epoch, class);
    let objects: Arc<dyn Objects> = Arc::new(Groups::of(p, plan.clone(), class));
    let targets: Vec<Target> = (groups.start..groups.end.min(objects.count()))
        .filter(|&g| !on_disk(p, plan, class, g))
        .map(|index| Target { listing, index })
        .collect();
    p.prefetch(&targets, &objects);
}

/// Sample `k` of class `class` in `plan`: its group, its place in the group, and its id.
fn sample(plan: &ClassPlan, class: usize, k: u64) -> Result<(u64, usize, u32), ReadError> {
    let (g, within) = (k / plan.group as u64, k as usize % plan.group);
    let id = plan
        .group_ids(class, g)
        .get(within)
        .ok_or_else(|| ReadError::NotFound(format!("sample {k} of class {class}")))?;
    Ok((g, within, *id))
}

/// Sample `id`, as the node cache files it.
fn key_of(table: &SampleTable, id: u32) -> crate::node_cache::Key {
    crate::node_cache::Key::sample(Sent { bytes: table.bytes[id as usize], crc32c: table.crc32c[id as usize] }, id)
}

/// Whether every sample of group `g` of class `class` in `plan` opens from the node cache's disk
/// ([`Reads::from_disk`]): passthrough hands the kernel the node cache's files, and it holds each sample
/// ([`Prefetcher::on_disk`]). Such a group is not fetched into memory: its samples would be read twice.
/// Asked of the disk once per group and plan (a `stat` per sample); a sample gone from the disk since is
/// fetched with its group when it is read.
fn on_disk(p: &Prefetcher, plan: &ClassPlan, class: usize, g: u64) -> bool {
    if !p.serves_from_disk() {
        return false;
    }
    let Some(table) = p.shuffled_table() else { return false };
    let mut known = plan.on_disk.lock().expect("on_disk");
    *known
        .entry((class, g))
        .or_insert_with(|| plan.group_ids(class, g).iter().map(|&id| key_of(&table, id)).all(|s| p.on_disk(s)))
}

/// Per group being read, a bit per sample read to its end: a group whose samples have all been read leaves
/// the cache at once (no epoch reads it again: the next epoch's groups are other samples).
#[derive(Default)]
pub struct Reads(Mutex<HashMap<(u64, u32, u64), u64>>);

impl Reads {
    /// Reads `[offset, offset + size)` of sample `k` of class `class` in `plan`, from its group (its bytes
    /// verified, or found cached), and says whether the read stalled ([`Prefetcher::read_stalled`]).
    /// `owner` identifies the reading process.
    pub fn read(
        &self,
        p: &Arc<Prefetcher>,
        (plan, class, k): (&ClassPlan, usize, u64),
        offset: u64,
        size: u32,
        owner: u32,
    ) -> Result<(Bytes, bool), ReadError> {
        let table = p.sample_table()?;
        let (g, within, id) = sample(plan, class, k)?;
        let ids = plan.group_ids(class, g);
        let len = table.bytes[id as usize];
        if offset >= len || size == 0 {
            return Ok((Bytes::new(), false));
        }
        let start: u64 = ids[..within].iter().map(|&i| table.bytes[i as usize]).sum();
        let size = (len - offset).min(u64::from(size)) as u32;
        let key = ObjectKey { listing: listing(plan.epoch, class), index: g };
        let (bytes, stalled) = p.read_stalled(key, start + offset, size, owner)?;
        if offset + bytes.len() as u64 >= len {
            self.done(p, (plan, class, k));
        }
        Ok((bytes, stalled))
    }

    /// Sample `k` of class `class` in `plan` as the node cache's own file, checked, for the kernel to serve
    /// (FUSE passthrough), if the node cache holds it and it is at most [`crate::prefetch::DISK_WHOLE_MAX`]: no `READ`
    /// reaches the daemon, and nothing is copied into memory. The sample counts as read.
    pub fn from_disk(
        &self,
        p: &Arc<Prefetcher>,
        (plan, class, k): (&ClassPlan, usize, u64),
    ) -> Result<Option<Arc<std::fs::File>>, ReadError> {
        let table = p.sample_table()?;
        let (_, _, id) = sample(plan, class, k)?;
        let file = p.disk_backing(key_of(&table, id));
        if file.is_some() {
            self.done(p, (plan, class, k));
        }
        Ok(file)
    }

    /// Sample `k` of class `class` in `plan` was read to its end: its group leaves the cache once all its
    /// samples have been.
    fn done(&self, p: &Arc<Prefetcher>, (plan, class, k): (&ClassPlan, usize, u64)) {
        let (g, within) = (k / plan.group as u64, k as usize % plan.group);
        let members = plan.group_ids(class, g).len();
        let all = if members >= 64 { u64::MAX } else { (1u64 << members) - 1 };
        let mut read = self.0.lock().expect("read");
        let mask = read.entry((plan.epoch, class as u32, g)).or_insert(0);
        *mask |= 1 << within;
        if *mask == all {
            read.remove(&(plan.epoch, class as u32, g));
            drop(read);
            p.forget(ObjectKey { listing: listing(plan.epoch, class), index: g });
        }
    }
}
