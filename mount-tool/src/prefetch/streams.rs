//! Stream detection: which batches to keep ahead of the readers of each listing, from the batches read.
//!
//! **The window follows the plan, not the thread.** Loaders read an epoch directory in a few shapes:
//! file order (DALI, tf.data, `cat`; often from a thread pool, so slightly out of order and from many
//! thread ids), worker or rank stride (DataLoader workers, DDP rank *r* of *N* on this node), and
//! contiguous ranges (DALI `shard_id`). So the evidence is which batches of a listing are read, not who
//! reads them:
//!
//! - A **stream** is (head, stride): the furthest batch read along it and the step between its batches.
//!   A read a few steps past the head (up to one window) advances it; one behind it, within a window,
//!   belongs to it (a thread pool reading out of order). Either way the stream's window is returned: the
//!   `window` batches after the head along its stride, those not read yet.
//! - The **first read of a listing** starts a trusted stride-1 stream at once, with the full window:
//!   an epoch directory is read whole (the plan says so), and ramping up by round trips is what short
//!   epochs cannot afford. A listing of DALI `.idx` twins gets all of its files at its first read:
//!   they are tiny, and DALI reads every one of them at pipeline build.
//! - A later read that fits no stream is **isolated**: it is remembered as the candidate of its reading
//!   process (the thread group, not the thread) and starts nothing. The same process's next read, a
//!   stride of at most `max_stride` past it, makes a trusted stream of that stride (a DDP rank, a range
//!   shard). Random reads therefore start nothing after the listing's first window.
//! - **Across epochs**: a stream whose window runs past the end of epoch *e* continues into epoch
//!   *e + 1* where the stream starts (its *origin*: a stride-*k* stream of rank *r* at batch *r*, a DALI
//!   range shard at its first batch), so the next epoch's first batches are warm when the reader gets
//!   there.
//! - **Wrapping around**: batch 0 of an epoch read again after a window reached its end, then its next
//!   ones up to [`WRAP_READS`], are a loader finishing the epoch (DALI's reader reads on past the last file
//!   into the first ones): their window is the rest of those first batches, and nothing else changes
//!   (other ranks' streams go on). A read just past them is a new pass (a pipeline built once over one
//!   directory): the epoch starts afresh with the full window, and once one was seen, every read of batch
//!   0 again is. Once readers were seen to wrap around, a window past an epoch's end is split between the
//!   stream's own first batches in this epoch (at most half the window) and the next epoch's start.
//! - **First batches**: once readers were seen to wrap around, each stream's first reads of an epoch
//!   ([`WRAP_READS`] each; a window's worth shared by the listing's streams once a new pass was seen) are
//!   reported ([`Observed::firsts`]), and the cache keeps them once read: DALI reads them again as it
//!   wraps around, each rank its own shard's. Kept for a loader that never wraps around (PyTorch), or a
//!   window's worth under DALI, they held memory files that new bodies could have been received into.
//!
//! State is bounded: `max_listings` listings (least recently read dropped first), `max_streams`
//! streams and candidates per listing, and one bit per batch of the listings tracked.

use super::kinds::Follow;
use super::Listing;

/// The batches of its stream's first ones DALI's reader reads again as it wraps around at an epoch's end:
/// its last batch's records and its prefetch queue's (`prefetch_queue_depth` 2) come from 1-4 files.
const WRAP_READS: u64 = 4;

/// One batch to keep cached ahead of a reader: `listing` may be the next epoch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub listing: Listing,
    pub index: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Stream {
    head: u64,
    stride: u64,
    used: u64,
    /// Where the stream starts in every epoch: its first read (a range shard's start, a rank's phase), or
    /// its phase where that read was within a window of it (a thread pool's first reads, out of order).
    origin: u64,
}

impl Stream {
    fn new(batch: u64, stride: u64, window: u64, used: u64) -> Self {
        let origin = if batch < stride * window { batch % stride } else { batch };
        Stream { head: batch, stride, used, origin }
    }
}

/// What [`StreamTracker::observe`] found for a read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// The batches to keep ahead of the read's stream, nearest first (`listing` may be the next epoch's).
    pub targets: Vec<Target>,
    /// Batches of the read's listing among the first of their stream in the epoch, which a loader reads
    /// again as it wraps around at the epoch's end (DALI fills its last batch from its shard's first
    /// files): this read's, and the first read of a stream that this read confirmed.
    pub firsts: Vec<u64>,
}

/// An isolated read, waiting for its process's next read to say whether it starts a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Candidate {
    owner: u32,
    batch: u64,
    used: u64,
}

#[derive(Debug, Clone)]
struct ListingState {
    listing: Listing,
    batches: u64,
    /// One bit per batch: read at least once.
    read: Vec<u64>,
    streams: Vec<Stream>,
    candidates: Vec<Candidate>,
    used: u64,
    /// A stream's window reached the last batch.
    ended: bool,
    /// Which of the first `WRAP_READS` batches were read again after a stream's window reached the end
    /// (one bit each): a loader finishing the epoch (DALI), or the start of a new pass.
    rereads: u64,
}

impl ListingState {
    fn new(listing: Listing, batches: u64) -> Self {
        ListingState {
            listing,
            batches,
            read: vec![0; batches.div_ceil(64) as usize],
            streams: Vec::new(),
            candidates: Vec::new(),
            used: 0,
            ended: false,
            rereads: 0,
        }
    }

    fn was_read(&self, batch: u64) -> bool {
        self.read.get((batch / 64) as usize).is_some_and(|w| w & (1 << (batch % 64)) != 0)
    }

    /// Marks `batch` read; returns whether it was read before.
    fn mark(&mut self, batch: u64) -> bool {
        let word = &mut self.read[(batch / 64) as usize];
        let bit = 1 << (batch % 64);
        let before = *word & bit != 0;
        *word |= bit;
        before
    }
}

/// Recognizes reader streams per listing (see the module note).
#[derive(Debug, Clone)]
pub struct StreamTracker {
    listings: Vec<ListingState>,
    max_listings: usize,
    max_streams: usize,
    max_stride: u64,
    clock: u64,
    /// Readers were seen to read an epoch again from its start after its end (DALI at every epoch's end).
    wraps: bool,
    /// A reader was seen to read an epoch through again from its start (a pipeline built once over one
    /// directory), not only its first few batches (DALI's reader, finishing an epoch).
    passes: bool,
}

impl StreamTracker {
    /// A tracker of up to `max_streams` streams per listing, recognizing strides up to `max_stride`.
    pub fn new(max_streams: usize, max_stride: u64) -> Self {
        StreamTracker {
            listings: Vec::new(),
            max_listings: 16,
            max_streams: max_streams.max(1),
            max_stride: max_stride.max(1),
            clock: 0,
            wraps: false,
            passes: false,
        }
    }

    /// Records a read of `batch` (of `batches` in `listing`) by process `owner` (0 when unknown) and
    /// returns the batches to keep ahead of the stream it belongs to, nearest first: at most `window`
    /// of them, fewer near the end of the last epoch, none for an isolated read. `follow` says whether the
    /// first read asks for every batch and whether windows run on into the next epoch. Also says which
    /// batches are among the first of their stream (`Observed::firsts`): a window's worth shared by the
    /// listing's streams (at least `WRAP_READS` each).
    pub fn observe(
        &mut self,
        owner: u32,
        listing: Listing,
        (batch, batches): (u64, u64),
        window: usize,
        follow: Follow,
    ) -> Observed {
        self.clock += 1;
        let clock = self.clock;
        if window == 0 || batch >= batches {
            return Observed::default();
        }
        let (max_streams, max_stride) = (self.max_streams, self.max_stride);
        let passes_before = self.passes;
        let state = self.state(listing, batches);
        let reread = state.ended && state.was_read(batch);
        // The epoch's first batches read again after its end: DALI's reader fills its last batch from its
        // first files, and from now on windows that reach an epoch's end warm those too.
        let finishing = reread && batch < WRAP_READS && (batch == 0 || state.rereads != 0);
        if finishing {
            state.rereads |= 1 << batch;
        }
        let new_pass = (finishing && batch == 0 && passes_before)
            || (reread && state.rereads == (1 << WRAP_READS) - 1 && (WRAP_READS..2 * WRAP_READS).contains(&batch));
        if new_pass {
            // Read further (or once pipelines were seen to): a new pass of a pipeline built once over this
            // directory. It starts afresh, with its full window from here.
            *state = ListingState::new(listing, batches);
            if batch > 0 {
                // The pass began at batch 0: its stream starts there.
                (0..batch).for_each(|b| _ = state.mark(b));
                state.streams.push(Stream { head: batch - 1, ..Stream::new(0, 1, window as u64, clock) });
            }
        } else if finishing {
            // A loader finishing the epoch: no new window, only the rest of what it reads then, cached
            // already where its stream's first batches were kept. Nothing else changes.
            state.used = clock;
            let targets =
                (batch + 1..WRAP_READS.min(batches)).take(window).map(|index| Target { listing, index }).collect();
            self.wraps = true;
            return Observed { targets, firsts: Vec::new() };
        }
        self.wraps |= finishing;
        self.passes |= new_pass;
        let (wraps, passes) = (self.wraps, self.passes);
        let state = self.state(listing, batches);
        state.used = clock;
        let first = state.read.iter().all(|&w| w == 0);
        let again = state.mark(batch);
        if first && follow.all_at_first {
            // Every twin at once: DALI reads them all at pipeline build.
            let targets = (0..batches).filter(|&b| b != batch).map(|index| Target { listing, index }).collect();
            return Observed { targets, firsts: Vec::new() };
        }
        let reach = window as u64;
        // The stream this read advances or falls within: the fewest steps away, the longest stride first
        // (a rank's stride stream is not lost to a stride-1 stream passing by).
        let fits = state
            .streams
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                let (lo, hi) = (s.head.saturating_sub(s.stride * reach), s.head + s.stride * reach);
                (lo..=hi).contains(&batch) && (batch.abs_diff(s.head)) % s.stride == 0
            })
            .min_by_key(|(_, s)| (batch.abs_diff(s.head) / s.stride, std::cmp::Reverse(s.stride)))
            .map(|(i, _)| i);
        let mut confirmed_from = None;
        let i = match fits {
            Some(i) => {
                let s = &mut state.streams[i];
                s.head = s.head.max(batch);
                s.used = clock;
                i
            }
            None if first => push(&mut state.streams, Stream::new(batch, 1, reach, clock), max_streams),
            None if again => return Observed::default(),
            None => {
                let confirmed = state
                    .candidates
                    .iter()
                    .position(|c| c.owner == owner && batch > c.batch && batch - c.batch <= max_stride);
                match confirmed {
                    Some(c) => {
                        let from = state.candidates.swap_remove(c).batch;
                        confirmed_from = Some(from);
                        let stream = Stream { head: batch, ..Stream::new(from, batch - from, reach, clock) };
                        push(&mut state.streams, stream, max_streams)
                    }
                    None => {
                        // One candidate per process: its next read confirms it or replaces it.
                        state.candidates.retain(|c| c.owner != owner);
                        let candidate = Candidate { owner, batch, used: clock };
                        if state.candidates.len() >= max_streams {
                            let oldest = (0..state.candidates.len()).min_by_key(|&i| state.candidates[i].used);
                            state.candidates.swap_remove(oldest.expect("nonempty"));
                        }
                        state.candidates.push(candidate);
                        return Observed::default();
                    }
                }
            }
        };
        let s = state.streams[i].clone();
        // What a loader reads again as it wraps around, once loaders were seen to: each stream's first
        // `WRAP_READS` batches, or a window's worth shared by the streams where a pipeline reads passes
        // (the new pass's window then finds them cached).
        let steps =
            if passes { (reach / s.stride.max(state.streams.len() as u64)).max(WRAP_READS) } else { WRAP_READS };
        let is_first = |b: u64| {
            wraps && b >= s.origin && (b - s.origin).is_multiple_of(s.stride) && (b - s.origin) / s.stride < steps
        };
        let firsts = confirmed_from.into_iter().chain([batch]).filter(|&b| is_first(b)).collect();
        let mut out = Vec::with_capacity(window);
        let mut next = s.head + s.stride;
        while out.len() < window && next < batches {
            if !state.was_read(next) {
                out.push(Target { listing, index: next });
            }
            next += s.stride;
        }
        if next >= batches {
            state.ended = true;
        }
        // The window runs on past the epoch's end, from where the stream starts (its phase, or a range
        // shard's start): into the next epoch, and, once readers were seen to wrap around, half of it into
        // this epoch's own.
        let from_start =
            |listing, n: usize| (0..n as u64).map(move |k| Target { listing, index: s.origin + k * s.stride });
        let spill = window - out.len();
        let wrap = if wraps { spill.div_ceil(2).min(steps as usize) } else { 0 };
        let wrapped: Vec<Target> =
            from_start(listing, wrap).filter(|t| t.index < batches && !out.contains(t)).collect();
        out.extend(wrapped);
        let next = listing.next_epoch().filter(|_| follow.into_next_epoch);
        out.extend(next.into_iter().flat_map(|next| from_start(next, spill - wrap)));
        Observed { targets: out, firsts }
    }

    /// The state of `listing`, created (dropping the least recently read one) if absent.
    fn state(&mut self, listing: Listing, batches: u64) -> &mut ListingState {
        let found = self.listings.iter().position(|l| l.listing == listing && l.batches == batches);
        let i = match found {
            Some(i) => i,
            None => {
                self.listings.retain(|l| l.listing != listing);
                if self.listings.len() >= self.max_listings {
                    let oldest = (0..self.listings.len()).min_by_key(|&i| self.listings[i].used).expect("nonempty");
                    self.listings.swap_remove(oldest);
                }
                self.listings.push(ListingState::new(listing, batches));
                self.listings.len() - 1
            }
        };
        &mut self.listings[i]
    }
}

/// Adds `stream`, dropping the least recently used one when `max` are kept; returns its position.
fn push(streams: &mut Vec<Stream>, stream: Stream, max: usize) -> usize {
    if streams.len() >= max {
        let oldest = (0..streams.len()).min_by_key(|&i| streams[i].used).expect("nonempty");
        streams.swap_remove(oldest);
    }
    streams.push(stream);
    streams.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::views::epochs::batches;
    use batchfs::encode::BatchFormat;
    use proptest::prelude::*;

    const TF: BatchFormat = BatchFormat::Tfrecord;
    const L: Listing = batches::listing(0, TF);
    const L1: Listing = batches::listing(1, TF);

    impl StreamTracker {
        /// [`StreamTracker::observe`] of a read of `batch` of `batches`, followed as its view says.
        fn see(&mut self, owner: u32, listing: Listing, batch: u64, batches: u64, window: usize) -> Vec<Target> {
            self.observe(owner, listing, (batch, batches), window, listing.kind.follow(listing)).targets
        }
    }

    /// The targets in `listing`, as batch numbers.
    fn within(targets: &[Target], listing: Listing) -> Vec<u64> {
        targets.iter().filter(|t| t.listing == listing).map(|t| t.index).collect()
    }

    #[test]
    fn the_first_read_of_an_epoch_gets_the_full_window_wherever_it_lands() {
        let mut t = StreamTracker::new(8, 16);
        assert_eq!(within(&t.see(7, L, 0, 100, 3), L), vec![1, 2, 3]);
        assert_eq!(within(&t.see(9, L, 0, 100, 3), L), vec![1, 2, 3], "a re-read keeps the window");
        assert_eq!(within(&t.see(8, L, 1, 100, 3), L), vec![2, 3, 4], "another thread, same stream");
        // A DALI range shard: the first read of its epoch starts mid-way.
        let mut t = StreamTracker::new(8, 16);
        assert_eq!(within(&t.see(1, L, 50, 100, 4), L), vec![51, 52, 53, 54]);
    }

    #[test]
    fn many_threads_reading_one_stream_out_of_order_earn_the_full_window() {
        // A thread pool reads batches 0..40 in file order, a few at a time and out of order, each read
        // from another thread id: one stream, its window always full ahead of the furthest read.
        let mut t = StreamTracker::new(8, 16);
        let order: Vec<u64> = (0..40u64).map(|b| b ^ 1).collect(); // 1, 0, 3, 2, ...
        for (k, &b) in order.iter().enumerate() {
            let got = within(&t.see(1000 + k as u32, L, b, 1000, 8), L);
            let furthest = *order[..=k].iter().max().unwrap();
            let want: Vec<u64> = (furthest + 1..=furthest + 8).filter(|x| !order[..=k].contains(x)).collect();
            assert_eq!(got, want, "read {k} (batch {b})");
        }
    }

    #[test]
    fn dataloader_workers_reading_round_robin_share_one_window() {
        // Four worker processes take batches 0, 1, 2, 3, 4... in turn.
        let mut t = StreamTracker::new(8, 16);
        for b in 0..20u64 {
            let got = within(&t.see(100 + (b % 4) as u32, L, b, 1000, 6), L);
            assert_eq!(got, (b + 1..=b + 6).collect::<Vec<_>>(), "batch {b}");
        }
    }

    #[test]
    fn interleaved_ranks_each_get_their_own_stream() {
        // Four DDP ranks on one node, each its own process reading every 4th batch, out of phase: rank r
        // is 10 * r steps behind rank 0. After a few reads, every read has its rank's next batch ahead.
        let mut t = StreamTracker::new(8, 16);
        let mut predicted = [0usize; 4];
        for step in 0..60u64 {
            for rank in 0..4u64 {
                let Some(own) = step.checked_sub(10 * rank) else { continue };
                let b = rank + own * 4;
                let got = within(&t.see(10 + rank as u32, L, b, 1000, 3), L);
                if own >= 3 {
                    assert!(got.contains(&(b + 4)), "rank {rank} at batch {b}: {got:?}");
                    predicted[rank as usize] += 1;
                }
            }
        }
        assert!(predicted.iter().all(|&n| n >= 20), "{predicted:?}");
    }

    #[test]
    fn a_rank_alone_on_its_node_reads_a_stride() {
        // This node holds rank 2 of 8: the first read is batch 2, the rest every 8th.
        let mut t = StreamTracker::new(8, 16);
        assert_eq!(within(&t.see(5, L, 2, 1000, 3), L), vec![3, 4, 5], "first read: file order assumed");
        assert_eq!(within(&t.see(5, L, 10, 1000, 3), L), Vec::<u64>::new(), "8 past: isolated");
        assert_eq!(within(&t.see(5, L, 18, 1000, 3), L), vec![26, 34, 42], "stride 8 confirmed");
    }

    #[test]
    fn random_reads_start_nothing_after_the_first_window() {
        let mut t = StreamTracker::new(8, 4);
        let reads = [500u64, 37, 912, 240, 771, 15, 640, 333, 108, 455, 820, 61, 290, 705];
        let started: Vec<usize> = reads.iter().map(|&b| t.see(9, L, b, 1000, 16).len()).collect();
        assert_eq!(started[0], 16, "the epoch's first read");
        assert!(started[1..].iter().all(|&n| n == 0), "{started:?}");
    }

    #[test]
    fn a_stream_near_the_end_of_an_epoch_warms_the_next_one() {
        let mut t = StreamTracker::new(8, 16);
        for b in 0..=7 {
            t.see(1, L, b, 10, 4);
        }
        let got = t.see(1, L, 8, 10, 4);
        assert_eq!(within(&got, L), vec![9]);
        assert_eq!(within(&got, L1), vec![0, 1, 2], "the rest of the window, from the next epoch's start");
        // A stride-3 stream of phase 1 continues at batch 1 of the next epoch.
        let mut t = StreamTracker::new(8, 16);
        t.see(1, L, 50, 100, 3);
        for b in (1..94).step_by(3) {
            t.see(2, L, b, 100, 3);
        }
        let got = t.see(2, L, 94, 100, 3);
        assert_eq!(within(&got, L), vec![97]);
        assert_eq!(within(&got, L1), vec![1, 4]);
    }

    #[test]
    fn a_pass_that_wraps_around_starts_afresh_and_is_then_expected() {
        let mut t = StreamTracker::new(8, 16);
        for b in 0..10 {
            t.see(1, L, b, 10, 4);
        }
        // DALI's reader reads on into the first files while it finishes the epoch: only as far as it
        // reads then (`WRAP_READS`), kept cached since. A full window here was fetched again for nothing
        // at every epoch's end.
        assert_eq!(within(&t.see(1, L, 0, 10, 4), L), vec![1, 2, 3]);
        assert_eq!(within(&t.see(1, L, 1, 10, 4), L), vec![2, 3]);
        t.see(1, L, 2, 10, 4);
        t.see(1, L, 3, 10, 4);
        assert!(!t.passes);
        // Read further: a new pass of a pipeline built once, with its full window.
        assert_eq!(within(&t.see(1, L, 4, 10, 4), L), vec![5, 6, 7, 8]);
        assert!(t.passes);
        for b in 5..8 {
            t.see(1, L, b, 10, 4);
        }
        // Now a window past the end warms both this epoch's start and the next epoch's.
        let got = t.see(1, L, 8, 10, 4);
        assert_eq!(within(&got, L), vec![9, 0, 1]);
        assert_eq!(within(&got, L1), vec![0]);
    }

    /// Only loaders seen to wrap around have their first batches kept, and only as many as DALI reads again
    /// (`WRAP_READS`), not a window's worth: kept, those could give their memory files to no new body, and
    /// more bodies went into fresh files.
    #[test]
    fn first_batches_are_kept_once_loaders_wrap_around_and_only_those_they_read_again() {
        let firsts = |t: &mut StreamTracker, listing: Listing| -> Vec<u64> {
            (0..20).flat_map(|b| t.observe(1, listing, (b, 20), 8, listing.kind.follow(listing)).firsts).collect()
        };
        let mut t = StreamTracker::new(8, 16);
        assert_eq!(firsts(&mut t, L), Vec::<u64>::new(), "a loader that never wrapped around (PyTorch)");
        for b in 0..3 {
            t.see(1, L, b, 20, 8);
        }
        assert_eq!(firsts(&mut t, L1), vec![0, 1, 2, 3]);
        // A window past the end warms only those of its own epoch (not half of it), the rest goes to the
        // next epoch.
        let (l2, l3) = (batches::listing(2, TF), batches::listing(3, TF));
        for b in 0..19 {
            t.see(1, l2, b, 20, 16);
        }
        let got = t.see(1, l2, 19, 20, 16);
        assert_eq!((within(&got, l2), within(&got, l3)), (vec![0, 1, 2, 3], (0..12).collect()));
    }

    #[test]
    fn index_twins_are_all_fetched_at_the_first_read() {
        let idx = batches::listing(0, BatchFormat::TfrecordIdx);
        let mut t = StreamTracker::new(8, 16);
        assert_eq!(within(&t.see(1, idx, 0, 47, 4), idx), (1..47).collect::<Vec<_>>());
        assert!(t.see(1, idx, 1, 47, 4).len() <= 4, "afterwards, an ordinary stream");
    }

    #[test]
    fn state_is_bounded() {
        let mut t = StreamTracker::new(4, 16);
        for e in 0..100u64 {
            for b in (0..1000u64).step_by(97) {
                t.see(b as u32, batches::listing(e, TF), b, 1000, 4);
            }
        }
        assert!(t.listings.len() <= 16);
        assert!(t.listings.iter().all(|l| l.streams.len() <= 4 && l.candidates.len() <= 4));
    }

    proptest! {
        /// Whatever the reads, targets are batches of the listing (or the next epoch's), at most `window`
        /// of them, none repeated, and until a pass wraps around (batch 0 read again) none already read.
        #[test]
        fn targets_are_bounded_and_unread(
            reads in proptest::collection::vec((0u32..4, 0u64..64), 1..200),
            window in 1usize..12,
        ) {
            let mut t = StreamTracker::new(6, 8);
            let mut read = std::collections::HashSet::new();
            let mut wrapped = false;
            for (owner, b) in reads {
                wrapped |= b == 0 && read.contains(&0);
                read.insert(b);
                let got = t.see(owner, L, b, 64, window);
                prop_assert!(got.len() <= window);
                let mut seen = std::collections::HashSet::new();
                for target in &got {
                    prop_assert!(seen.insert((target.listing, target.index)));
                    if target.listing == L {
                        prop_assert!(target.index < 64 && (wrapped || !read.contains(&target.index)));
                    } else {
                        prop_assert_eq!(target.listing, L1);
                    }
                }
            }
        }
    }

    #[test]
    fn range_shards_keep_their_first_batches_and_run_on_into_the_next_epoch_from_their_start() {
        // Two DALI ranks with `shard_id` on one node, side by side: rank 0 reads batches 0..50, rank 1
        // 50..100. Each wraps around to its own shard's first batches at the end, and starts the next
        // epoch there: both were fetched again, on demand, at every epoch's end and start.
        let mut t = StreamTracker::new(8, 16);
        let epoch = |t: &mut StreamTracker, listing: Listing| {
            let (mut firsts, mut next) = (Vec::new(), [Vec::new(), Vec::new()]);
            for k in 0..50u64 {
                for rank in 0..2 {
                    let o = t.observe(10 + rank as u32, listing, (50 * rank + k, 100), 6, listing.kind.follow(listing));
                    firsts.extend(o.firsts);
                    let after = listing.next_epoch();
                    next[rank as usize].extend(o.targets.iter().filter(|t| Some(t.listing) == after).map(|t| t.index));
                }
            }
            for rank in 0..2u64 {
                t.observe(10 + rank as u32, listing, (50 * rank, 100), 6, listing.kind.follow(listing));
            }
            firsts.sort_unstable();
            (firsts, next)
        };
        let (firsts, _) = epoch(&mut t, L);
        assert!(firsts.is_empty(), "no loader was seen to wrap around yet");
        let (firsts, next) = epoch(&mut t, L1);
        // What DALI reads as it wraps around (4 each): rank 1's shard start counts from its first read,
        // which its second confirmed.
        assert_eq!(firsts, vec![0, 1, 2, 3, 50, 51, 52, 53]);
        assert_eq!(next[0].first(), Some(&0), "rank 0 runs on into the next epoch at batch 0");
        assert_eq!(next[1].first(), Some(&50), "rank 1 runs on into the next epoch at its shard's start");
        // Rank 0 wraps around while rank 1 finishes its shard: not a new pass, and rank 1's window still
        // runs on into the next epoch.
        let (l2, l3) = (batches::listing(2, TF), batches::listing(3, TF));
        for k in 0..48u64 {
            t.see(10, l2, k, 100, 6);
            t.see(11, l2, 50 + k, 100, 6);
        }
        t.see(10, l2, 48, 100, 6);
        t.see(10, l2, 49, 100, 6);
        t.see(10, l2, 0, 100, 6);
        t.see(11, l2, 98, 100, 6);
        let got = t.see(11, l2, 99, 100, 6);
        assert!(within(&got, l3).contains(&50), "{got:?}");
        assert!(!t.passes);
    }
}
