//! `shuffled/` (docs/SEMANTICS.md, "shuffled/"): the class folders of a file-tree dataset, each showing
//! this mount's share of the class's names; each open of a name in class *c* gets the next sample of class
//! *c* in the epoch's plan, whatever the name.
//!
//! **Who gets what.** A sample is handed out at lookup, to the thread that looked the name up (an open is a
//! lookup and an open by one thread, in one system call): the thread keeps it, whichever name of the class
//! it looks up again, until it opens it (the sample is then its file) or looks up a name of another class,
//! or [`STALE`] passes (the sample then goes back, to be handed out before the class's next one: a `stat`
//! or an `ls -l` that never opens loses nothing). So concurrent readers never share a sample, and every
//! sample of an epoch is handed out once. Each class runs through its samples of one epoch, then of the
//! next, from `first_epoch` through `first_epoch + epochs`, then from `first_epoch` again.
//!
//! **Windows.** When a class hands out sample *k*, the groups holding its next samples are fetched
//! ([`crate::prefetch`]'s `shuffled` room), and the first time an epoch is reached, the first groups of
//! every class are: a reader's first sample of each class is not a round trip. The windows span
//! [`WINDOW_GROUPS`] groups at first, and twice as many (up to [`WINDOW_GROWTH`] times) each time a read
//! past a class's first window stalls: a slow or distant link gets the depth it needs, a near one keeps
//! the memory and the short first waits of small windows.

use crate::fs::views::undelivered::Undelivered;
use crate::fs::FsError;
use crate::ledger::{key, rest, tags, Ledger};
use crate::prefetch::{ClassPlan, Prefetcher, WINDOW_GROUPS, WINDOW_GROWTH};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a thread keeps a sample it looked up and did not open before it goes back.
pub const STALE: Duration = Duration::from_secs(10);

/// A sample handed out to a thread: `(epoch, k)` of its class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pending {
    class: u32,
    epoch: u64,
    k: u64,
    at: Instant,
}

#[derive(Default)]
struct Inner {
    /// Per class: the next sample `(epoch, k)` not yet handed out.
    cursors: HashMap<u32, (u64, u64)>,
    /// Per class: samples handed out and given back unopened, handed out before the cursor's.
    returned: HashMap<u32, VecDeque<(u64, u64)>>,
    /// Per thread: the sample its last lookup got, not yet opened.
    pending: HashMap<u32, Pending>,
    /// Epochs whose first groups of every class were asked for.
    warmed: HashSet<u64>,
}

/// The view's state.
pub(super) struct ShuffledView {
    /// Class names (the dataset's first directories), by label.
    pub classes: Vec<String>,
    first_epoch: u64,
    epochs: u64,
    inner: Mutex<Inner>,
    /// Each class's names (this mount's share, sorted), once listed.
    names: Mutex<HashMap<u32, Arc<Vec<String>>>>,
    /// The class folders' lists and the first epoch's first groups were asked for.
    asked_ahead: std::sync::atomic::AtomicBool,
    /// Groups each class's window spans now ([`ShuffledView::stalled`]).
    window: AtomicU64,
    /// Where the cursors are written through to, for a worker that takes over.
    ledger: Option<Arc<Ledger>>,
    /// Samples `(class, epoch, k)` opened whose reads timed out, none having succeeded: given back at
    /// their last close ([`ShuffledView::closed`]).
    undelivered: Undelivered<(u32, u64, u64)>,
}

impl ShuffledView {
    pub fn new(classes: Vec<String>, first_epoch: u64, epochs: u64) -> Self {
        ShuffledView {
            classes,
            first_epoch,
            epochs: epochs.max(1),
            inner: Mutex::default(),
            names: Mutex::default(),
            asked_ahead: Default::default(),
            window: AtomicU64::new(WINDOW_GROUPS),
            ledger: None,
            undelivered: Undelivered::default(),
        }
    }

    /// Takes the class cursors `ledger` holds (a worker before this one wrote them) and writes every move
    /// through to it. Samples handed out and not opened before the takeover are not handed out again.
    pub fn record_in(&mut self, ledger: Arc<Ledger>) {
        let inner = self.inner.get_mut().expect("shuffled");
        for (k, v) in ledger.cells(tags::SHUFFLED_CURSOR) {
            let class = rest(k) as u32;
            inner.cursors.insert(class, ((v - 1) >> 24, (v - 1) & ((1 << 24) - 1)));
        }
        self.ledger = Some(ledger);
    }

    /// The first time `shuffled/` is looked into: lists every class folder in the background (a walk
    /// then finds them listed) and fetches the sample table, the first epoch's plan and every class's
    /// first groups, so that neither the walk nor the first samples of each class wait a round trip each.
    pub fn ahead(&self, prefetcher: &Arc<Prefetcher>) {
        if self.asked_ahead.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        prefetcher.list_dirs_ahead(self.classes.clone());
        self.first_time(self.first_epoch);
        let (prefetcher, classes, epoch) = (prefetcher.clone(), self.classes.len(), self.first_epoch);
        let warm = move || match prefetcher.class_plan(epoch, classes) {
            Ok(plan) => (0..classes).for_each(|c| super::groups::prefetch(&prefetcher, &plan, c, 0..WINDOW_GROUPS)),
            Err(e) => tracing::debug!(error = %e, "shuffled/: the first epoch's plan, ahead, failed"),
        };
        if let Err(e) = std::thread::Builder::new().name("batchfs-shuffled".into()).spawn(warm) {
            tracing::debug!(error = %e, "shuffled/: cannot warm ahead");
        }
    }

    /// Groups each class's window spans now.
    pub fn window_groups(&self) -> u64 {
        self.window.load(Ordering::Relaxed)
    }

    /// A read of sample `k` of its class, in groups of `group`, stalled: past the class's first window
    /// (which every epoch's start waits for), the windows double, up to `most` groups ([`WINDOW_GROWTH`]
    /// times their first span at most). Returns whether they grew.
    pub fn stalled(&self, k: u64, group: u64, most: u64) -> bool {
        if k < WINDOW_GROUPS * group.max(1) {
            return false;
        }
        let most = most.min(WINDOW_GROUPS * WINDOW_GROWTH);
        let grown =
            self.window.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| (w < most).then(|| (w * 2).min(most)));
        if let Ok(was) = grown {
            tracing::debug!(from = was, to = (was * 2).min(most), "shuffled/: a read stalled, the windows grow");
        }
        grown.is_ok()
    }

    /// The class named `name`.
    pub fn class(&self, name: &str) -> Option<u32> {
        self.classes.iter().position(|c| c == name).map(|c| c as u32)
    }

    /// The plan of `epoch`.
    pub fn plan(&self, prefetcher: &Prefetcher, epoch: u64) -> Result<Arc<ClassPlan>, FsError> {
        Ok(prefetcher.class_plan(epoch, self.classes.len())?)
    }

    /// Class `class`'s names: its files (below its folder, a deeper path's `/` written `_`, a name that
    /// then repeats another made unique: [`unique_names`]), sorted, this mount's share of them
    /// (`share=R/W`: every W-th from the R-th), as many as it has samples.
    pub fn names(&self, prefetcher: &Prefetcher, class: u32) -> Result<Arc<Vec<String>>, FsError> {
        if let Some(n) = self.names.lock().expect("names").get(&class) {
            return Ok(n.clone());
        }
        let root = self.classes.get(class as usize).ok_or(FsError::NotFound)?;
        let mut all = Vec::new();
        let mut dirs = vec![root.clone()];
        while let Some(dir) = dirs.pop() {
            let (_, list) = prefetcher.list_dir(&dir)?;
            dirs.extend(list.dirs.iter().map(|d| format!("{dir}/{d}")));
            let below = |p: &str| p.strip_prefix(root.as_str()).map(|r| r.trim_start_matches('/').replace('/', "_"));
            all.extend(list.files.iter().filter_map(|f| below(&f.path)));
        }
        let all = unique_names(all);
        let (rank, world) = prefetcher.shuffled_share();
        let samples = self.plan(prefetcher, self.first_epoch)?.order.get(class as usize).map_or(0, Vec::len);
        let mut names: Vec<String> = all.into_iter().skip(rank as usize).step_by(world.max(1) as usize).collect();
        if names.len() != samples {
            tracing::warn!(
                class = %root,
                names = names.len(),
                samples,
                "shuffled/: a class folder's files are not its samples one for one; names shown: one per sample"
            );
            names.truncate(samples);
            while names.len() < samples {
                names.push(format!("sample-{:07}", names.len()));
            }
            names.sort_unstable();
        }
        let names = Arc::new(names);
        self.names.lock().expect("names").insert(class, names.clone());
        Ok(names)
    }

    /// The sample thread `tid` gets by looking up a name of class `class`: `(epoch, k)`. `samples` is the
    /// class's count per epoch (the same every epoch).
    pub fn reserve(&self, tid: u32, class: u32, samples: u64) -> Option<(u64, u64)> {
        if samples == 0 {
            return None;
        }
        let now = Instant::now();
        let mut inner = self.inner.lock().expect("shuffled");
        let inner = &mut *inner;
        if let Some(p) = inner.pending.get_mut(&tid) {
            if p.class == class {
                p.at = now;
                return Some((p.epoch, p.k));
            }
        }
        // What this thread, or any, looked up and never opened goes back.
        let stale: Vec<u32> = inner
            .pending
            .iter()
            .filter(|(&t, p)| t == tid || now.duration_since(p.at) >= STALE)
            .map(|(&t, _)| t)
            .collect();
        for t in stale {
            let p = inner.pending.remove(&t).expect("listed");
            inner.returned.entry(p.class).or_default().push_back((p.epoch, p.k));
        }
        let got = match inner.returned.get_mut(&class).and_then(VecDeque::pop_front) {
            Some(back) => back,
            None => {
                let cursor = inner.cursors.entry(class).or_insert((self.first_epoch, 0));
                let got = *cursor;
                *cursor = if got.1 + 1 < samples { (got.0, got.1 + 1) } else { (self.next_epoch(got.0), 0) };
                if let Some(ledger) = &self.ledger {
                    ledger.set(key(tags::SHUFFLED_CURSOR, class.into()), (cursor.0 << 24 | cursor.1) + 1);
                }
                got
            }
        };
        inner.pending.insert(tid, Pending { class, epoch: got.0, k: got.1, at: now });
        Some(got)
    }

    /// The epoch after `epoch` in the span (after the last, the first again).
    fn next_epoch(&self, epoch: u64) -> u64 {
        let next = epoch + 1;
        if next >= self.first_epoch + self.epochs {
            tracing::info!(first_epoch = self.first_epoch, "shuffled/: past the last epoch, the first again");
            self.first_epoch
        } else {
            next
        }
    }

    /// Thread `tid` opened sample `(epoch, k)` of `class`: it is its own now.
    pub fn opened(&self, tid: u32, class: u32, epoch: u64, k: u64) {
        let mut inner = self.inner.lock().expect("shuffled");
        if inner.pending.get(&tid).is_some_and(|p| (p.class, p.epoch, p.k) == (class, epoch, k)) {
            inner.pending.remove(&tid);
        }
    }

    /// A read of an opened sample failed (its group did not come within `timeout`: the server down, say).
    /// Unless a later read of it succeeds, the sample goes back at its last close, to be handed out before
    /// the class's next: it was the file's from its open, so a loader that skips a sample it cannot read,
    /// or opens the name again, lost it from the epoch (and read the next epoch's in its place).
    pub fn read_failed(&self, class: u32, epoch: u64, k: u64) {
        self.undelivered.failed((class, epoch, k));
    }

    /// A read of an opened sample succeeded: it is delivered, whatever reads of it failed before.
    pub fn read_succeeded(&self, class: u32, epoch: u64, k: u64) {
        self.undelivered.succeeded(&(class, epoch, k));
    }

    /// The last handle of an opened sample was closed: one whose every read failed goes back.
    pub fn closed(&self, class: u32, epoch: u64, k: u64) {
        if self.undelivered.take(&(class, epoch, k)) {
            tracing::info!(class, epoch, k, "shuffled/: a sample no read of got goes back, for the next open");
            self.inner.lock().expect("shuffled").returned.entry(class).or_default().push_front((epoch, k));
        }
    }

    /// Whether `epoch` is reached for the first time (its first groups are to be fetched).
    pub fn first_time(&self, epoch: u64) -> bool {
        self.inner.lock().expect("shuffled").warmed.insert(epoch)
    }
}

/// The window of a class that hands out sample `k` of its `samples` an epoch, in groups of `group`: the
/// groups of this epoch from `k`'s, and of the next epoch's, that hold the class's next `window × group`
/// samples after `k`.
pub fn window(k: u64, group: u64, samples: u64, window: u64) -> (std::ops::Range<u64>, std::ops::Range<u64>) {
    let group = group.max(1);
    let end = k + window * group;
    let here = k / group..(end.min(samples) - 1) / group + 1;
    let next = if end > samples { 0..((end - samples).min(samples) - 1) / group + 1 } else { 0..0 };
    (here, next)
}

/// `names`, sorted, each once: a name that repeats one before it (`deep/x.jpg` flattened is `deep_x.jpg`,
/// as a file of that name is) gets `~N` before its extension, the first N that no other name has. A folder
/// listing a name twice is no folder a loader can trust (ImageFolder lists both, `os.scandir` too).
pub fn unique_names(mut names: Vec<String>) -> Vec<String> {
    names.sort_unstable();
    let mut taken: std::collections::HashSet<String> = std::collections::HashSet::with_capacity(names.len());
    let mut repeated = Vec::new();
    for name in names.drain(..) {
        if taken.contains(&name) {
            repeated.push(name);
        } else {
            taken.insert(name);
        }
    }
    for name in repeated {
        let (stem, ext) = match name.rfind('.').filter(|&at| at > 0) {
            Some(at) => name.split_at(at),
            None => (name.as_str(), ""),
        };
        let unique = (1..).map(|n| format!("{stem}~{n}{ext}")).find(|n| !taken.contains(n)).expect("a free name");
        taken.insert(unique);
    }
    let mut names: Vec<String> = taken.into_iter().collect();
    names.sort_unstable();
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A flattened path that repeats a file's name is made unique, sorted, and nothing is lost.
    #[test]
    fn names_are_each_listed_once() {
        let got =
            unique_names(vec!["deep_x.jpg".into(), "a.jpg".into(), "deep_x.jpg".into(), "x_y".into(), "x_y".into()]);
        assert_eq!(got, ["a.jpg", "deep_x.jpg", "deep_x~1.jpg", "x_y", "x_y~1"]);
        // A made name that is taken already takes the next number.
        let got = unique_names(vec!["b.png".into(), "b.png".into(), "b~1.png".into()]);
        assert_eq!(got, ["b.png", "b~1.png", "b~2.png"]);
    }

    proptest! {
        #[test]
        fn unique_names_keep_the_count_and_repeat_none(names in proptest::collection::vec("[ab_~.]{0,4}", 0..40)) {
            let got = unique_names(names.clone());
            prop_assert_eq!(got.len(), names.len());
            let set: std::collections::BTreeSet<&String> = got.iter().collect();
            prop_assert_eq!(set.len(), got.len());
            prop_assert!(got.windows(2).all(|w| w[0] < w[1]));
        }
    }

    fn view() -> ShuffledView {
        ShuffledView::new(vec!["a".into(), "b".into()], 3, 2)
    }

    #[test]
    fn windows_grow_where_reads_past_the_first_window_stall_and_no_further_than_their_growth() {
        let v = view();
        assert_eq!(v.window_groups(), WINDOW_GROUPS);
        // Groups of 10: samples 0-19 are the first window, which every epoch's start waits for.
        let most = WINDOW_GROUPS * WINDOW_GROWTH;
        assert!(!v.stalled(0, 10, most) && !v.stalled(19, 10, most));
        assert_eq!(v.window_groups(), WINDOW_GROUPS, "a stall in the first window grows nothing");
        assert!(v.stalled(20, 10, most));
        assert_eq!(v.window_groups(), 2 * WINDOW_GROUPS);
        while v.stalled(500, 10, most) {}
        assert_eq!(v.window_groups(), most, "doubled up to its growth");
        assert!(!v.stalled(500, 10, 1000), "and no further");
        // Windows whose bytes allow no growth (many classes) stay as they are.
        let v = view();
        assert!(!v.stalled(500, 1, WINDOW_GROUPS));
        assert_eq!(v.window_groups(), WINDOW_GROUPS);
    }

    #[test]
    fn a_thread_keeps_its_sample_until_it_opens_it() {
        let v = view();
        assert_eq!(v.reserve(7, 0, 3), Some((3, 0)));
        assert_eq!(v.reserve(7, 0, 3), Some((3, 0)), "a second lookup of the class: the same sample");
        assert_eq!(v.reserve(8, 0, 3), Some((3, 1)), "another thread: the next");
        v.opened(7, 0, 3, 0);
        assert_eq!(v.reserve(7, 0, 3), Some((3, 2)), "opened: the next lookup gets the next");
        v.opened(7, 0, 3, 2);
        assert_eq!(v.reserve(7, 0, 3), Some((4, 0)), "the class's epoch is done: the next epoch");
        v.opened(7, 0, 4, 0);
        assert_eq!(v.reserve(9, 1, 1), Some((3, 0)), "each class its own cursor");
        v.opened(9, 1, 3, 0);
        assert_eq!(v.reserve(9, 1, 1), Some((4, 0)));
        v.opened(9, 1, 4, 0);
        assert_eq!(v.reserve(9, 1, 1), Some((3, 0)), "past the span: its first epoch again");
        assert_eq!(v.reserve(9, 1, 0), None, "a class with no samples in this share");
    }

    #[test]
    fn a_sample_looked_up_and_never_opened_goes_back() {
        let v = view();
        assert_eq!(v.reserve(1, 0, 10), Some((3, 0)));
        // Thread 1 looks up a name of another class: its class-0 sample goes back, handed out next.
        assert_eq!(v.reserve(1, 1, 10), Some((3, 0)));
        assert_eq!(v.reserve(2, 0, 10), Some((3, 0)), "the sample given back");
        assert_eq!(v.reserve(3, 0, 10), Some((3, 1)));
    }

    /// A sample whose every read failed (its group never came: the server down past `timeout`) goes back
    /// at its last close, handed out before the class's next: the loader that skips it, or opens the name
    /// again, loses nothing from the epoch. One read of which succeeded is delivered: not handed out twice.
    #[test]
    fn a_sample_no_read_got_goes_back_at_its_close() {
        let v = view();
        assert_eq!(v.reserve(1, 0, 10), Some((3, 0)));
        v.opened(1, 0, 3, 0);
        v.read_failed(0, 3, 0);
        v.closed(0, 3, 0);
        assert_eq!(v.reserve(1, 0, 10), Some((3, 0)), "the failed sample handed out again");
        v.opened(1, 0, 3, 0);
        v.read_failed(0, 3, 0);
        v.read_succeeded(0, 3, 0);
        v.closed(0, 3, 0);
        assert_eq!(v.reserve(1, 0, 10), Some((3, 1)), "read at last: delivered");
        // Given back once, then opened with no read through the daemon (the node cache's file): delivered.
        v.opened(1, 0, 3, 1);
        v.read_failed(0, 3, 1);
        v.closed(0, 3, 1);
        assert_eq!(v.reserve(1, 0, 10), Some((3, 1)));
        v.opened(1, 0, 3, 1);
        v.closed(0, 3, 1);
        v.opened(1, 0, 3, 1);
        v.closed(0, 3, 1);
        assert_eq!(v.reserve(1, 0, 10), Some((3, 2)), "a sample closed with no failure is delivered");
    }

    proptest! {
        /// No class starves and none holds more than its share: the window always holds the group of the
        /// sample handed out and the class's next `window × group` samples (on into the next epoch), and
        /// never more than `window + 2` groups (an epoch's last group may be short).
        #[test]
        fn windows_hold_the_next_samples_and_no_more(
            samples in 1u64..500,
            group in 1u64..65,
            window in 1u64..4,
            at in 0u64..500,
        ) {
            let k = at % samples;
            let (here, next) = super::window(k, group, samples, window);
            let groups = samples.div_ceil(group);
            prop_assert!(here.contains(&(k / group)), "the sample's own group");
            prop_assert!(here.end <= groups && next.end <= groups);
            prop_assert!((here.end - here.start) + (next.end - next.start) <= window + 2);
            // Every sample among the next window × group (wrapping into the next epoch) is covered.
            for ahead in 0..(window * group).min(2 * samples) {
                let j = k + ahead;
                if j < samples {
                    prop_assert!(here.contains(&(j / group)), "{} of this epoch", j);
                } else if j - samples < samples {
                    prop_assert!(next.contains(&((j - samples) / group)), "{} of the next", j - samples);
                }
            }
        }

        /// Threads looking up and opening in any interleaving, some never opening what they looked up:
        /// every sample of an epoch is opened at most once, and, once every thread has opened, those
        /// handed out and given back are handed out again: nothing is lost.
        #[test]
        fn no_two_opens_share_a_sample_and_none_is_lost(
            steps in proptest::collection::vec((0u32..4, 0u32..2, any::<bool>()), 1..200),
        ) {
            let v = ShuffledView::new(vec!["a".into(), "b".into()], 0, 1000);
            let n = 1_000_000;
            let mut opened = HashSet::new();
            let mut held: HashMap<u32, (u32, u64, u64)> = HashMap::new();
            for (tid, class, open) in steps {
                let (epoch, k) = v.reserve(tid, class, n).unwrap();
                held.insert(tid, (class, epoch, k));
                if open {
                    v.opened(tid, class, epoch, k);
                    prop_assert!(opened.insert((class, epoch, k)), "opened twice: {:?}", (class, epoch, k));
                    held.remove(&tid);
                }
            }
            // Each thread opens what it holds; then every class's samples below its cursor were opened.
            for (tid, (class, epoch, k)) in held {
                v.opened(tid, class, epoch, k);
                prop_assert!(opened.insert((class, epoch, k)));
            }
            for class in 0..2u32 {
                loop {
                    let inner = v.inner.lock().unwrap();
                    let back = inner.returned.get(&class).is_some_and(|r| !r.is_empty());
                    drop(inner);
                    if !back {
                        break;
                    }
                    let (epoch, k) = v.reserve(99, class, n).unwrap();
                    v.opened(99, class, epoch, k);
                    prop_assert!(opened.insert((class, epoch, k)));
                }
                let next = v.inner.lock().unwrap().cursors.get(&class).copied().unwrap_or((0, 0));
                let below = opened.iter().filter(|&&(c, e, k)| c == class && (e, k) < next).count() as u64;
                prop_assert_eq!(below, next.1, "class {}: every sample before the cursor opened once", class);
            }
        }
    }
}
